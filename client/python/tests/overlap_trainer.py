"""A trainer process for test_overlap_step.py and test_world.py: trains the named session with
overlap=True for STEPS steps, then runs the next step's forward and backward (every bucket but
the last is handed to the daemon, whose step now waits for it), prints "mid-step <STEPS + 1>"
and waits to be SIGKILLed. With WORLD_KEY: one rank of that world session, under AVERAGE.

    overlap_trainer.py TARGET SESSION_NAME STEPS [WORLD_KEY]
"""
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import diond.torch  # noqa: E402
from test_overlap_step import BUCKET, groups_for, loop  # noqa: E402
from test_torch_optimizer import batch, make_model, mse  # noqa: E402


def main():
    target, name, steps = sys.argv[1], sys.argv[2], int(sys.argv[3])
    world = dict(gradient_sync="average", world_key=sys.argv[4]) if len(sys.argv) > 4 else {}
    model = make_model()
    opt = diond.torch.Optimizer(groups_for(model, "muon"), target=target, session=name,
                                arena="shm", overlap=True, overlap_bucket_bytes=BUCKET, **world)
    loop(model, opt, steps)
    x, y = batch(steps + 1)
    opt.zero_grad()
    mse(model(x), y).backward()
    assert opt._ov.started and opt._ov.rung, "no bucket was handed over"
    print("mid-step %d" % (steps + 1), flush=True)
    while True:  # the test SIGKILLs us: no step(), no close()
        time.sleep(60)


if __name__ == "__main__":
    main()
