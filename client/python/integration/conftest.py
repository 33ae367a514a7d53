"""The integration suite: diond under other people's training code (HF Trainer, Lightning,
JAX). Its packages are not Debian's: scripts/test-integrations.sh installs the pinned
requirements.txt into a venv over Debian's python3 and runs this folder there. A daemon per
module, as in ../tests."""
import pytest

import diond


@pytest.fixture(scope="module")
def daemon():
    d = diond.Daemon(compute_threads=2).start()
    yield d
    rc = d.stop()
    d.cleanup()
    assert rc == 0, "diond did not exit cleanly after SIGTERM: %s\n%s" % (rc, d.log_tail())
