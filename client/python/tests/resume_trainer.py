"""A trainer process for test_resume.py: builds the test model, creates (or resumes) the named
session, trains until the daemon's step counter reaches TOTAL (printing "step <k>" after each
step), prints "trained <TOTAL>" and waits to be SIGKILLed.

    resume_trainer.py TARGET SESSION_NAME TOTAL REMOTE(0|1)
"""
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import diond.torch  # noqa: E402
from test_torch_optimizer import groups, make_model, train  # noqa: E402


def main():
    target, name, total, remote = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4] == "1"
    model = make_model()
    opt = diond.torch.Optimizer(groups(model), target=target, session=name, resume=True,
                                remote=remote)
    print("resumed %d" % opt.param_groups[0]["step"], flush=True)
    for s in range(opt.param_groups[0]["step"] + 1, total + 1):
        train(model, opt, 1, first=s)
        print("step %d" % s, flush=True)
    print("trained %d" % opt.param_groups[0]["step"], flush=True)
    while True:  # the test SIGKILLs us: no close(), no finalizer
        time.sleep(60)


if __name__ == "__main__":
    main()
