"""Hugging Face Trainer with diond.torch.Optimizer against a real daemon: a small GPT-2 made
from a config (nothing downloaded) trains, a checkpoint resumed with resume_from_checkpoint
continues bit for bit, and a model trained in a function outlives its Trainer and optimizer."""
import gc

import pytest
import torch
import transformers

import diond.torch

VOCAB, CTX = 64, 16


def make_model():
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=VOCAB, n_positions=CTX, n_embd=32, n_layer=2,
                                  n_head=2, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return transformers.GPT2LMHeadModel(cfg)


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n=64):
        g = torch.Generator().manual_seed(1)
        start = torch.randint(0, VOCAB, (n, 1), generator=g)
        self.ids = (start + torch.arange(CTX)) % VOCAB  # learnable: each token is the last + 1

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def optimizer(model, target, **kw):
    hidden = [p for n, p in model.named_parameters() if ".h." in n and p.dim() == 2]
    rest = [p for n, p in model.named_parameters() if not (".h." in n and p.dim() == 2)]
    return diond.torch.Optimizer([dict(params=hidden, algorithm="dion2", lr=0.05),
                                  dict(params=rest, algorithm="adamw", lr=1e-2)],
                                 target=target, **kw)


def trainer(model, opt, out, steps=24, **kw):
    args = transformers.TrainingArguments(
        output_dir=str(out), max_steps=steps, per_device_train_batch_size=8, save_steps=12,
        lr_scheduler_type="constant",
        logging_steps=1, report_to=[], use_cpu=True, seed=0, save_safetensors=False,
        disable_tqdm=True, dataloader_num_workers=0, **kw)
    return transformers.Trainer(model=model, args=args, train_dataset=Tokens(),
                                optimizers=(opt, None))


def losses(t):
    return [h["loss"] for h in t.state.log_history if "loss" in h]


def test_trainer_trains_and_resumes_exactly(daemon, tmp_path):
    model = make_model()
    opt = optimizer(model, daemon.target)
    t = trainer(model, opt, tmp_path / "a")
    t.train()
    straight = {k: v.clone() for k, v in model.state_dict().items()}
    ls = losses(t)
    assert len(ls) == 24 and sum(ls[-4:]) < 0.8 * sum(ls[:4]), ls
    opt.close()

    model = make_model()
    opt = optimizer(model, daemon.target)
    t = trainer(model, opt, tmp_path / "b")
    t.train(resume_from_checkpoint=str(tmp_path / "a" / "checkpoint-12"))
    for k, v in model.state_dict().items():
        assert torch.equal(v, straight[k]), k
    opt.close()


def test_model_outlives_trainer_and_optimizer(daemon, tmp_path):
    def train():
        model = make_model()
        t = trainer(model, optimizer(model, daemon.target), tmp_path / "c", steps=4)
        t.train()
        return model, {k: v.clone() for k, v in model.state_dict().items()}

    model, last = train()
    gc.collect()
    junk = [torch.randn(1 << 16) for _ in range(64)]
    del junk
    for k, v in model.state_dict().items():
        assert torch.equal(v, last[k]), k
    out = model(input_ids=Tokens()[0]["input_ids"][None], labels=Tokens()[0]["labels"][None])
    assert torch.isfinite(out.loss)
    with diond.Client(daemon.target) as c:
        assert c.list_sessions() == []


def run_overlap(daemon, out, overlap, **kw):
    model = make_model()
    opt = optimizer(model, daemon.target, overlap=overlap, overlap_bucket_bytes=16384)
    t = trainer(model, opt, out, **kw)
    t.train()
    stats = opt.overlap_stats
    saved = torch.load(out / "checkpoint-12" / "pytorch_model.bin")
    final = {k: v.clone() for k, v in model.state_dict().items()}
    opt.close()
    return losses(t), saved, final, stats


def assert_same(a, b):
    assert a[0] == b[0]
    for i in (1, 2):
        assert a[i].keys() == b[i].keys()
        for k in a[i]:
            assert torch.equal(a[i][k], b[i][k]), k


def test_trainer_with_overlap_equals_synchronous(daemon, tmp_path):
    """overlap=True under the Trainer (max_grad_norm=0: no clipping in the trainer) equals
    overlap=False bit for bit: the losses, the checkpoint saved at step 12 (right after an
    overlapped step(): model.state_dict() waits for it) and the final weights."""
    sync = run_overlap(daemon, tmp_path / "s", False, max_grad_norm=0.0)
    ov = run_overlap(daemon, tmp_path / "o", True, max_grad_norm=0.0)
    assert ov[3]["buckets"] >= 2 and ov[3]["overlapped"] == 23 and ov[3]["synchronous"] == 0
    assert_same(sync, ov)


def test_trainer_clipping_makes_overlapped_steps_synchronous(daemon, tmp_path):
    """The Trainer's default max_grad_norm=1.0 clips after backward: every step falls back to a
    synchronous one (one warning), with the synchronous run's numbers."""
    sync = run_overlap(daemon, tmp_path / "s", False)
    with pytest.warns(RuntimeWarning, match="ran synchronously"):
        ov = run_overlap(daemon, tmp_path / "o", True)
    assert ov[3]["overlapped"] == 0 and ov[3]["synchronous"] == 23
    assert_same(sync, ov)
