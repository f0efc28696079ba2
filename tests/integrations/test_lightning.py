"""dpkit.lightning with the real lightning package: the Trainer's and Fabric's runs under every dpkit mode on
2 and 3 virtual CPU devices end with a single-device run's weights (and logs, outputs, predictions), with
Dropout, shuffled batches and a last batch that splits unevenly; checkpoints are clean and resume exactly;
what is not supported is refused before any step runs."""

from __future__ import annotations

import logging
import warnings

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

L = pytest.importorskip("lightning", reason="lightning is not installed (pip install -e '.[test]')")

from lightning.fabric import Fabric  # noqa: E402
from lightning.pytorch.callbacks import Callback, ModelCheckpoint  # noqa: E402
from lightning.pytorch.plugins.precision import MixedPrecision  # noqa: E402

import dpkit.lightning  # noqa: E402
from closeness import assert_close_to_scale, difference_to_scale  # noqa: E402
from dpkit.lightning import DataParallelStrategy, FabricDataParallelStrategy  # noqa: E402

TOLERANCE = 1e-5  # of each tensor's size (tests/closeness.py): the replicas sum in other orders than one device
MODES = dpkit.lightning.modes()
ROWS, BATCH = 23, 8  # batches of 8, 8 and 7: 7 rows split 4 + 3 on two devices, 8 rows 3 + 3 + 2 on three

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning")
logging.getLogger("lightning").setLevel(logging.ERROR)
logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
logging.getLogger("lightning.fabric").setLevel(logging.ERROR)


def devices(n: int) -> list[str]:
    return [f"cpu:{i}" for i in range(n)]


def dataset(rows: int = ROWS) -> TensorDataset:
    generator = torch.Generator().manual_seed(7)
    return TensorDataset(torch.randn(rows, 6, generator=generator), torch.randint(0, 3, (rows,), generator=generator))


class Tiny(L.LightningModule):
    """Linear, ReLU, Dropout, Linear: no BatchNorm; every step logs, training_step returns per-row extras."""

    def __init__(self, dropout: float = 0.25, lr: float = 0.1):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Dropout(dropout), nn.Linear(16, 3))
        self.lr = lr

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        loss = nn.functional.cross_entropy(logits, y)
        self.log("train_loss", loss, on_step=True, on_epoch=True)
        self.log("train_rows", float(len(y)), reduce_fx="sum", on_step=True, on_epoch=False)
        return {"loss": loss, "preds": logits.argmax(dim=1), "correct": (logits.argmax(dim=1) == y).sum()}

    def validation_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.cross_entropy(self(x), y)
        self.log("val_loss", loss)
        return loss

    def test_step(self, batch, batch_idx):
        x, y = batch
        self.log("test_loss", nn.functional.cross_entropy(self(x), y))

    def predict_step(self, batch, batch_idx):
        return self(batch[0]).softmax(dim=1)

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)
        return {"optimizer": optimizer, "lr_scheduler": torch.optim.lr_scheduler.StepLR(optimizer, 2, gamma=0.5)}


class Outputs(Callback):
    """What training_step returned to Lightning, batch by batch."""

    def __init__(self):
        self.seen = []

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self.seen.append({key: value.detach().clone() for key, value in outputs.items()})


def trainer(strategy, **kwargs) -> L.Trainer:
    settings = dict(
        accelerator="cpu",
        max_epochs=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    settings.update(kwargs)
    return L.Trainer(strategy=strategy, **settings)


def loader(shuffle: bool = True, rows: int = ROWS) -> DataLoader:
    return DataLoader(dataset(rows), batch_size=BATCH, shuffle=shuffle)


def full_run(strategy, **kwargs) -> dict:
    """fit (shuffled batches, validation every epoch), test and predict; everything one device must match."""
    torch.manual_seed(0)
    model, outputs = Tiny(), Outputs()
    run = trainer(strategy, callbacks=[outputs], **kwargs)
    run.fit(model, loader(), loader(shuffle=False))
    metrics = {key: value.clone() for key, value in run.callback_metrics.items()}
    run.test(model, loader(shuffle=False), verbose=False)
    metrics["test_loss"] = run.callback_metrics["test_loss"].clone()
    predictions = torch.cat(run.predict(model, loader(shuffle=False)))
    return {
        "weights": [p.detach().clone() for p in model.parameters()],
        "metrics": metrics,
        "outputs": outputs.seen,
        "predictions": predictions,
        "strategy": run.strategy,
    }


@pytest.fixture(scope="module")
def single_device() -> dict:
    return full_run("auto", devices=1)


def assert_close(mine, reference, what: str) -> None:
    assert len(mine) == len(reference), what
    for k, (a, b) in enumerate(zip(mine, reference)):
        assert a.shape == b.shape, f"{what}[{k}]"
        if a.numel():
            assert_close_to_scale(a.float(), b.float(), TOLERANCE, f"{what}[{k}]")


@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("mode", MODES)
def test_trainer_run_equals_one_device(mode, n, single_device):
    mine = full_run(DataParallelStrategy(mode, devices=devices(n)))
    reference = single_device
    untrained = Tiny().parameters()
    assert any((a - b).abs().max() > 1e-3 for a, b in zip(reference["weights"], untrained)), "it must have trained"
    assert_close(mine["weights"], reference["weights"], f"{mode} on {n} devices: weights")
    assert sorted(mine["metrics"]) == sorted(reference["metrics"])
    for name in reference["metrics"]:  # train_loss_step/_epoch, train_rows, val_loss, test_loss
        assert_close([mine["metrics"][name]], [reference["metrics"][name]], f"{mode}: logged {name}")
    assert mine["metrics"]["train_rows"].item() == 7.0  # the last batch's rows: summed over the replicas
    assert len(mine["outputs"]) == len(reference["outputs"]) == 6  # every step saw the whole global batch
    for step, (a, b) in enumerate(zip(mine["outputs"], reference["outputs"])):
        assert torch.equal(a["preds"], b["preds"]), f"{mode}: step {step}'s per-row outputs"
        assert a["correct"].item() == b["correct"].item()  # a count: summed over the replicas
        assert_close([a["loss"]], [b["loss"]], f"{mode}: step {step}'s loss")
    assert_close([mine["predictions"]], [reference["predictions"]], f"{mode}: predictions")
    assert mine["strategy"].root_device == torch.device("cpu", 0)


def test_dropout_is_what_makes_the_check_strict(single_device):
    """The same runs without dropout end elsewhere: the equality above includes one device's dropout masks."""
    torch.manual_seed(0)
    model = Tiny(dropout=0.0)
    trainer("auto", devices=1, max_epochs=2).fit(model, loader())
    difference = max((a - b).abs().max().item() for a, b in zip(model.parameters(), single_device["weights"]))
    assert difference > 1e-3


class Normalized(Tiny):
    def __init__(self):
        super().__init__(dropout=0.0)
        self.net = nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 3))


def train_normalized(strategy, **kwargs) -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = Normalized()
    trainer(strategy, max_epochs=1, **kwargs).fit(model, loader())
    return [t.detach().clone() for t in [*model.parameters(), *model.buffers()]]


@pytest.fixture(scope="module")
def normalized_on_one_device() -> list[torch.Tensor]:
    return train_normalized("auto", devices=1)  # one device: BatchNorm over the whole batch


@pytest.mark.parametrize("mode", MODES)
def test_sync_batchnorm_gives_one_devices_batch_statistics(mode, normalized_on_one_device):
    mine = train_normalized(DataParallelStrategy(mode, devices=devices(3)), sync_batchnorm=True)
    assert_close(mine, normalized_on_one_device, f"{mode}: weights and running statistics")


def train_accumulating(strategy, clip: float | None = 0.05) -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = Tiny(lr=0.5)
    trainer(strategy, max_epochs=2, accumulate_grad_batches=2, gradient_clip_val=clip).fit(model, loader())
    return [p.detach().clone() for p in model.parameters()]


@pytest.fixture(scope="module")
def accumulated_on_one_device() -> list[torch.Tensor]:
    weights = train_accumulating("auto")
    unclipped = train_accumulating("auto", clip=None)
    assert max((a - b).abs().max().item() for a, b in zip(weights, unclipped)) > 1e-3, "the clipping must bite"
    return weights


@pytest.mark.parametrize("mode", MODES)
def test_gradient_accumulation_and_clipping_as_lightning_does_them(mode, accumulated_on_one_device):
    mine = train_accumulating(DataParallelStrategy(mode, devices=devices(3)))
    assert_close(mine, accumulated_on_one_device, mode)


class DtypeProbe(Tiny):
    seen: list[torch.dtype] = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        DtypeProbe.seen.append(logits.dtype)
        return nn.functional.cross_entropy(logits, y)


def train_bf16(strategy) -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = DtypeProbe()
    trainer(strategy, max_epochs=1, precision="bf16-mixed").fit(model, loader())
    return [p.detach().clone() for p in model.parameters()]


@pytest.fixture(scope="module")
def bf16_on_one_device() -> list[torch.Tensor]:
    DtypeProbe.seen = []
    weights = train_bf16("auto")
    assert DtypeProbe.seen and set(DtypeProbe.seen) == {torch.bfloat16}
    return weights


@pytest.mark.parametrize("mode", MODES)
def test_bf16_mixed_runs_in_bfloat16_in_every_replica(mode, bf16_on_one_device):
    reference = bf16_on_one_device
    DtypeProbe.seen = []
    mine = train_bf16(DataParallelStrategy(mode, devices=devices(2)))
    assert len(DtypeProbe.seen) == 6 and set(DtypeProbe.seen) == {torch.bfloat16}  # 3 steps x 2 replicas
    # bfloat16 rounds the split batches' matmuls alike, not bit for bit: 8 bits of mantissa, within 2e-3 of the
    # weights' size
    assert difference_to_scale(mine, reference) < 2e-3
    assert all(p.dtype == torch.float32 for p in mine)


def test_a_checkpoint_is_clean_and_resumes_exactly(tmp_path):
    # replicated on two devices: two epochs and a checkpoint (weights and the optimizer's momentum)
    torch.manual_seed(0)
    model = Tiny()
    saving = ModelCheckpoint(dirpath=tmp_path, filename="last", save_top_k=-1)
    strategy = DataParallelStrategy("replicated", devices=devices(2))
    trainer(strategy, max_epochs=2, callbacks=[saving], enable_checkpointing=True).fit(model, loader())
    path = tmp_path / "last.ckpt"
    checkpoint = torch.load(path, weights_only=False)
    assert list(checkpoint["state_dict"]) == list(Tiny().state_dict())  # no wrapper prefix
    bare = Tiny.load_from_checkpoint(path)
    assert_close(list(bare.parameters()), list(model.parameters()), "into a bare LightningModule")
    plain = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Dropout(0.25), nn.Linear(16, 3))
    state = dict(checkpoint["state_dict"])
    torch.nn.modules.utils.consume_prefix_in_state_dict_if_present(state, "net.")
    plain.load_state_dict(state)  # plain torch, strict
    assert_close(list(plain.parameters()), list(model.parameters()), "into plain torch")
    # a third epoch from the checkpoint, under replicated and on one device, from the same seed
    resumed, reference = Tiny(), Tiny()
    torch.manual_seed(1)
    trainer(DataParallelStrategy("replicated", devices=devices(2)), max_epochs=3).fit(resumed, loader(), ckpt_path=path)
    torch.manual_seed(1)
    trainer("auto", devices=1, max_epochs=3).fit(reference, loader(), ckpt_path=path)
    assert_close(list(resumed.parameters()), list(reference.parameters()), "resumed under replicated")
    assert any((a - b).abs().max() > 1e-3 for a, b in zip(resumed.parameters(), bare.parameters()))


def fabric_loop(fabric: Fabric, lightning_module: bool) -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = Tiny()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model, optimizer = fabric.setup(model, optimizer)
    criterion = nn.CrossEntropyLoss()
    if isinstance(fabric.strategy, FabricDataParallelStrategy):
        criterion = fabric.strategy.setup_criterion(criterion)
    data = fabric.setup_dataloaders(loader())
    for _ in range(2):
        for batch_idx, (x, y) in enumerate(data):
            optimizer.zero_grad()
            if lightning_module:
                loss = model.training_step((x, y), batch_idx)["loss"]
            else:
                loss = criterion(model(x), y)
            fabric.backward(loss)
            optimizer.step()
    return [p.detach().clone() for p in model.parameters()]


@pytest.fixture(scope="module")
def fabric_on_one_device() -> list[torch.Tensor]:
    return fabric_loop(Fabric(accelerator="cpu", devices=1), lightning_module=False)


@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("mode", MODES)
def test_fabric_loop_equals_one_device(mode, n, fabric_on_one_device):
    reference = fabric_on_one_device
    mine = fabric_loop(Fabric(strategy=FabricDataParallelStrategy(mode, devices=devices(n))), lightning_module=False)
    assert_close(mine, reference, f"fabric {mode} on {n} devices, criterion in the replicas")
    also = fabric_loop(Fabric(strategy=FabricDataParallelStrategy(mode, devices=devices(n))), lightning_module=True)
    assert_close(also, reference, f"fabric {mode} on {n} devices, model.training_step")


def test_fabric_accumulation_skips_the_sum_and_stays_exact():
    def run(strategy) -> list[torch.Tensor]:
        fabric = Fabric(strategy=strategy) if strategy else Fabric(accelerator="cpu", devices=1)
        torch.manual_seed(0)
        model = Tiny()
        model, optimizer = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
        for k, (x, y) in enumerate(fabric.setup_dataloaders(loader(shuffle=False))):
            with fabric.no_backward_sync(model, enabled=k % 2 == 0):
                fabric.backward(nn.functional.cross_entropy(model(x), y))
            if k % 2 == 1:
                optimizer.step()
                optimizer.zero_grad()
        return [p.detach().clone() for p in model.parameters()]

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "does not support skipping the gradient synchronization"
        mine = run(FabricDataParallelStrategy("replicated", devices=devices(2)))
    assert_close(mine, run(None), "accumulated under replicated")


def test_fabric_save_writes_clean_keys_and_load_reaches_the_replicas(tmp_path):
    fabric = Fabric(strategy=FabricDataParallelStrategy("replicated", devices=devices(2)))
    torch.manual_seed(0)
    model = Tiny()
    model, optimizer = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    x, y = dataset()[:BATCH]
    fabric.backward(nn.functional.cross_entropy(model(x), y))
    optimizer.step()
    fabric.save(tmp_path / "state.ckpt", {"model": model, "optimizer": optimizer})
    saved = torch.load(tmp_path / "state.ckpt", weights_only=False)
    assert list(saved["model"]) == list(Tiny().state_dict())
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    fabric.load(tmp_path / "state.ckpt", {"model": model, "optimizer": optimizer})
    replica = fabric.strategy._wrappers[0].persistent.replicas[1].module
    for name, value in saved["model"].items():
        assert torch.equal(model.state_dict()[name], value)
        assert torch.equal(replica.state_dict()[name], value), f"replica 1's {name}"


class Manual(Tiny):
    steps = 0

    def __init__(self):
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        Manual.steps += 1
        return super().training_step(batch, batch_idx)


def test_manual_optimization_is_refused_before_any_step():
    Manual.steps = 0
    with pytest.raises(ValueError, match=r"^automatic_optimization: Manual sets it to False"):
        trainer(DataParallelStrategy("dp", devices=devices(2))).fit(Manual(), loader())
    assert Manual.steps == 0


def test_bad_arguments_are_one_line_errors_at_construction():
    with pytest.raises(ValueError, match=r"^mode: expected one of 'dp', 'dp-balanced', 'replicated'.*got 'ddp'"):
        DataParallelStrategy("ddp", devices=devices(2))
    with pytest.raises(ValueError, match=r"^devices: expected a positive count.*got 0"):
        DataParallelStrategy("dp", devices=0)
    with pytest.raises(TypeError, match=r"^devices: expected a list"):
        FabricDataParallelStrategy("dp", devices="cpu:0")
    with pytest.raises(ValueError, match=r"^devices\[1\]"):
        DataParallelStrategy("dp", devices=["cpu:0", "tpu:1"])
    with pytest.raises(TypeError, match=r"^share_weights: not an option of mode 'dp' \(its options: concurrency\)"):
        DataParallelStrategy("dp", devices=devices(2), share_weights=False)
    with pytest.raises(
        ValueError, match=r"^devices: the strategy was given devices=2 but Lightning's devices= gives 3"
    ):
        trainer(DataParallelStrategy("dp", devices=2), devices=3)
    scaler = MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))
    with pytest.raises(ValueError, match=r"^precision: '16-mixed' is not supported with mode 'replicated'"):
        trainer(DataParallelStrategy("replicated", devices=devices(2)), plugins=[scaler])


class LogsAMetric(Tiny):
    def __init__(self):
        super().__init__()
        self.metric = MeanMetricLike()

    def training_step(self, batch, batch_idx):
        self.log("metric", self.metric)
        return super().training_step(batch, batch_idx)


class MeanMetricLike(nn.Module):
    """Looks like a torchmetrics Metric to dpkit: a module with compute()."""

    def compute(self) -> torch.Tensor:
        return torch.zeros(())


def test_logging_a_metric_object_in_a_replica_is_refused_with_what_to_do():
    with pytest.raises(TypeError, match=r"self.log\('metric', \.\.\.\): a torchmetrics Metric .*on_train_batch_end"):
        trainer(DataParallelStrategy("dp", devices=devices(2)), max_epochs=1).fit(LogsAMetric(), loader())


class SkipsSecondBatch(Tiny):
    def training_step(self, batch, batch_idx):
        return None if batch_idx == 1 else super().training_step(batch, batch_idx)


class SkipsSomeRows(Tiny):
    def training_step(self, batch, batch_idx):
        return None if len(batch[1]) < 3 else super().training_step(batch, batch_idx)


def train_skipping(strategy, module_class=SkipsSecondBatch) -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = module_class()
    trainer(strategy, max_epochs=1).fit(model, loader(shuffle=False))
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("mode", MODES)
def test_a_step_that_returns_none_is_skipped_as_on_one_device(mode):
    assert_close(train_skipping(DataParallelStrategy(mode, devices=devices(2))), train_skipping("auto"), mode)
    # a decision taken from a replica's own rows cannot skip the whole batch: a clear error
    with pytest.raises(RuntimeError, match=r"training_step: returned None \(skip the batch\) in some replicas"):
        train_skipping(DataParallelStrategy(mode, devices=["cpu:0", "cpu:1", "cpu:2"]), SkipsSomeRows)


class Calls:
    """Stands in for a LightningModule on the calling thread: what replay logs."""

    def __init__(self):
        self.logged = {}

    def log(self, name, value, **arguments):
        self.logged[name] = (value, arguments)


def test_replay_combines_the_replicas_log_calls_by_reduce_fx():
    from dpkit.integrations.lightning.logs import replay

    records = [
        (3, [("loss", torch.tensor(1.0), {}), ("top", 5.0, {"reduce_fx": "max"}), ("n", 3.0, {"reduce_fx": "sum"})]),
        (1, [("loss", torch.tensor(5.0), {}), ("top", 7.0, {"reduce_fx": "max"}), ("n", 1.0, {"reduce_fx": "sum"})]),
        (2, [("loss", torch.tensor(2.0), {"batch_size": 4}), ("low", -1.0, {"reduce_fx": "min"})]),
    ]
    module = Calls()
    replay(module, records, torch.device("cpu"))
    loss, arguments = module.logged["loss"]
    assert loss.item() == pytest.approx((3 * 1.0 + 1 * 5.0 + 4 * 2.0) / 8) and arguments == {"batch_size": 8}
    assert module.logged["top"][0].item() == 7.0 and module.logged["n"][0].item() == 4.0
    assert module.logged["low"][0].item() == -1.0 and module.logged["low"][1]["batch_size"] == 2
    with pytest.raises(ValueError, match=r"^self.log\('odd', reduce_fx='median'\): dpkit combines"):
        replay(Calls(), [(1, [("odd", 1.0, {"reduce_fx": "median"})])], torch.device("cpu"))


def test_registered_names_reach_the_trainer_and_fabric():
    run = trainer("dpkit_replicated", devices=3)
    assert isinstance(run.strategy, DataParallelStrategy) and run.strategy.mode == "replicated"
    assert run.strategy.parallel_devices == [torch.device("cpu", i) for i in range(3)]
    fabric = Fabric(strategy="dpkit_dp_balanced", accelerator="cpu", devices=2)
    assert isinstance(fabric.strategy, FabricDataParallelStrategy) and fabric.strategy.mode == "dp-balanced"
    assert fabric.strategy.parallel_devices == [torch.device("cpu", 0), torch.device("cpu", 1)]
    model = fabric.setup(Tiny())  # no fabric.launch() needed
    assert model(torch.randn(5, 6)).shape == (5, 3)
