"""PyTorch Lightning with diond.torch.Optimizer against a real daemon: a LightningModule
trains, a checkpoint resumed with ckpt_path continues bit for bit, the module is usable after
the Trainer is gone, and BackboneFinetuning's add_param_group keeps training."""
import gc

import pytorch_lightning as pl
import torch

import diond.torch

# Debian's torch 1.13 under Python 3.11 cannot import torch.distributed._shard (a dataclass
# field default that 3.11 refuses), which LightningModule.__init__ imports on torch < 2.1 only
# to register ShardedTensor hooks; no ShardedTensor is used here.
pl.LightningModule._register_sharded_tensor_state_dict_hooks_if_available = lambda self: None


class Net(pl.LightningModule):
    def __init__(self, target, overlap=False):
        super().__init__()
        torch.manual_seed(0)
        self.target = target
        self.overlap = overlap
        self.backbone = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(),
                                            torch.nn.Linear(32, 32), torch.nn.Tanh())
        self.head = torch.nn.Linear(32, 1)
        self.losses = []

    def forward(self, x):
        return self.head(self.backbone(x))

    def training_step(self, batch, _):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self(x), y)
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self):
        mats = [p for p in self.parameters() if p.dim() == 2 and p.requires_grad]
        vecs = [p for p in self.parameters() if p.dim() < 2 and p.requires_grad]
        return diond.torch.Optimizer([dict(params=mats, algorithm="muon", lr=0.02),
                                      dict(params=vecs, algorithm="adamw", lr=3e-3)],
                                     target=self.target, overlap=self.overlap,
                                     overlap_bucket_bytes=2048)


def loader():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(256, 8, generator=g)
    y = torch.sin(x.sum(1, keepdim=True))
    # One batch per epoch: Lightning 2.2 does not restore a plain DataLoader's position, and a
    # resumed epoch (also with torch.optim) would see another batch order than the straight run.
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=256)


def trainer(root, steps, callbacks=()):
    ckpt = pl.callbacks.ModelCheckpoint(dirpath=str(root), every_n_epochs=1, save_top_k=-1,
                                        filename="{step}")
    return pl.Trainer(max_steps=steps, accelerator="cpu", devices=1, logger=False,
                      enable_progress_bar=False, enable_model_summary=False,
                      callbacks=[ckpt, *callbacks], default_root_dir=str(root))


def weights(m):
    return {k: v.clone() for k, v in m.state_dict().items()}


def test_fit_resume_exactly_and_module_outlives_trainer(daemon, tmp_path):
    net = Net(daemon.target)
    t = trainer(tmp_path / "a", 24)
    t.fit(net, loader())
    straight = weights(net)
    assert net.losses[-1] < net.losses[0], net.losses
    del t
    gc.collect()  # the Trainer and its optimizer are gone: the module still works
    junk = [torch.randn(1 << 16) for _ in range(64)]
    del junk
    for k, v in net.state_dict().items():
        assert torch.equal(v, straight[k]), k
    assert torch.isfinite(net(torch.randn(4, 8))).all()

    resumed = Net(daemon.target)
    t = trainer(tmp_path / "b", 24)
    t.fit(resumed, loader(), ckpt_path=str(tmp_path / "a" / "step=8.ckpt"))
    for k, v in resumed.state_dict().items():
        assert torch.equal(v, straight[k]), k
    del t
    gc.collect()
    with diond.Client(daemon.target) as c:
        assert c.list_sessions() == []


class FineTuned(Net):
    def configure_optimizers(self):
        # BackboneFinetuning froze the backbone; its group comes later through add_param_group,
        # with the constructor's algorithm (AdamW here: the backbone has biases).
        return diond.torch.Optimizer([p for p in self.parameters() if p.requires_grad],
                                     algorithm="adamw", lr=3e-3, target=self.target)


def test_backbone_finetuning_adds_the_backbone(daemon, tmp_path):
    net = FineTuned(daemon.target)
    frozen = weights(net.backbone)
    cb = pl.callbacks.BackboneFinetuning(unfreeze_backbone_at_epoch=4, verbose=False)
    t = pl.Trainer(max_epochs=12, accelerator="cpu", devices=1, logger=False,
                   enable_progress_bar=False, enable_model_summary=False,
                   enable_checkpointing=False, callbacks=[cb],
                   default_root_dir=str(tmp_path))
    t.fit(net, loader())
    opt = t.optimizers[0]
    assert len(opt.param_groups) == 2
    moved = [not torch.equal(v, frozen[k]) for k, v in net.backbone.state_dict().items()]
    assert all(moved), "the backbone did not train after it joined"
    assert net.losses[-1] < net.losses[0]


def test_fit_with_overlap_equals_synchronous(daemon, tmp_path):
    """overlap=True under Lightning (its optimizer.step(closure) runs forward and backward inside
    step()) equals overlap=False bit for bit: the losses, the checkpoint at step 8 and the final
    weights."""
    runs = []
    for overlap in (False, True):
        net = Net(daemon.target, overlap=overlap)
        t = trainer(tmp_path / str(overlap), 24)
        t.fit(net, loader())
        stats = t.optimizers[0].overlap_stats
        ckpt = torch.load(str(tmp_path / str(overlap) / "step=8.ckpt"))["state_dict"]
        runs.append((net.losses, ckpt, weights(net), stats))
        del t
        gc.collect()
    assert runs[1][3]["buckets"] >= 2 and runs[1][3]["overlapped"] == 23
    assert runs[0][0] == runs[1][0]
    for i in (1, 2):
        for k, v in runs[0][i].items():
            assert torch.equal(v, runs[1][i][k]), k
