"""Training runs for the fsdp tests: one Engine loop, run here (the single-device reference) or in every
process in a launched group of the session (`launched_runs`), several runs per job."""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader, RandomSampler, TensorDataset

from dpkit.engine.engine import Engine


class Blocks(nn.Module):
    """A residual stack in a ModuleList, so the default rule makes each block a unit of its own."""

    def __init__(self, width: int = 32):
        super().__init__()
        self.embed = nn.Linear(20, width)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(3))
        self.head = nn.Linear(width, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)


@dataclass
class RunSpec:
    strategy: str = "single"
    accelerator: str = "cpu"
    devices: int = 1
    batch_size: int = 64
    steps: int = 4
    accumulate: int = 1
    optimizer: str = "sgd"
    clip: float | None = None
    precision: str = "32"
    options: dict | None = None
    save_at: int | None = None  # save_state at this step into `state`
    resume: bool = False  # load_state from `state` first
    state: str | None = None
    save_model: str | None = None  # engine.save(model, this) at the end
    load_model: str | None = None  # engine.load(this) after setup


def whole(tensor: torch.Tensor) -> torch.Tensor:
    """What one device would hold: a DTensor gathered (a collective)."""
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def data() -> TensorDataset:
    generator = torch.Generator().manual_seed(11)
    return TensorDataset(torch.randn(300, 20, generator=generator), torch.randint(0, 5, (300,), generator=generator))


def train(spec: RunSpec, close: bool = True) -> dict:
    """The weights after `spec.steps` steps and the gradient norm of every step (before clipping)."""
    engine = Engine(
        strategy=spec.strategy,
        accelerator=spec.accelerator,
        devices=spec.devices,
        accumulate=spec.accumulate,
        precision=spec.precision,
        progress=False,
        **(spec.options or {}),
    )
    torch.manual_seed(3)
    model = Blocks()
    optimizer = (
        torch.optim.Adam(model.parameters(), lr=0.01)
        if spec.optimizer == "adam"
        else torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    )
    model, optimizer = engine.setup(model, optimizer)
    criterion = engine.setup_criterion(nn.CrossEntropyLoss())
    order = RandomSampler(range(300), generator=torch.Generator().manual_seed(5))
    loader = engine.setup_dataloader(DataLoader(data(), batch_size=spec.batch_size, sampler=order))
    if spec.load_model:
        engine.load(spec.load_model)
    if spec.resume:
        engine.load_state(spec.state)
    if spec.save_at == 0:  # before any step: the optimizer has no state yet
        engine.save_state(spec.state)
    norms, micro_batches = [], 0
    while engine.step < spec.steps:
        for x, y in loader:
            optimizer.zero_grad()
            engine.backward(criterion(model(x), y))
            micro_batches += 1
            if spec.clip is not None and micro_batches % spec.accumulate == 0:
                norms.append(float(whole(torch.nn.utils.clip_grad_norm_(model.parameters(), spec.clip))))
            optimizer.step()
            if spec.save_at is not None and engine.step == spec.save_at:
                engine.save_state(spec.state)
            if engine.step == spec.steps:
                break
    if spec.save_model:
        engine.save(model, spec.save_model)
    bare = engine.model_copies()[0][0]
    weights = {name: whole(p.detach()).cpu().clone() for name, p in bare.named_parameters()}
    if close:
        engine.close()
    return {"weights": weights, "norms": norms}


def train_many(specs: list[dict]) -> list[dict]:
    """Every spec's result in this process, one after another (the Engine closed after the last)."""
    return [train(RunSpec(**spec), close=index == len(specs) - 1) for index, spec in enumerate(specs)]


def launched_runs(specs: list[RunSpec], devices: int, groups) -> list[list[dict]]:
    """Every spec's result in every process (results[rank][index]), run one after another in a launched group."""
    return groups(devices).run(train_many, [asdict(spec) for spec in specs])


def observed_memory(reshard_after_forward: bool) -> dict:
    """Two observed Adam steps under fsdp: the observer's books next to the bytes this process's tensors hold."""
    from dpkit.observe import Observer

    engine = Engine(
        strategy="fsdp", accelerator="cpu", devices=2, progress=False, reshard_after_forward=reshard_after_forward
    )
    torch.manual_seed(3)
    model = Blocks(width=64)
    model, optimizer = engine.setup(model, torch.optim.Adam(model.parameters(), lr=0.01))
    x, y = data().tensors
    bare = engine.model_copies()[0][0]

    def step() -> None:
        optimizer.zero_grad()
        engine.backward(nn.functional.cross_entropy(model(x[:32]), y[:32]))
        optimizer.step()

    step()
    with Observer(engine.device, models=engine.model_copies(), optimizers=[optimizer]) as observer:
        step()
        step()
    account = observer.ledger.accounts[str(engine.device)]

    def nbytes(tensors) -> int:  # each storage once: FSDP2's sharded gradients are views of one buffer
        storages = {}
        for tensor in tensors:
            storage = (tensor.to_local() if isinstance(tensor, DTensor) else tensor).untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
        return sum(storages.values())

    def gathered_bytes(module: nn.Module) -> int:  # whole parameters, dim 0 padded to a multiple of the processes
        return sum(-(-p.shape[0] // 2) * 2 * p[0].numel() * 4 for p in module.parameters())

    result = {
        "books": dict(account.current),
        "peaks": dict(account.category_peaks),
        "parameters": nbytes(bare.parameters()),
        "gradients": nbytes(p.grad for p in bare.parameters()),
        "optimizer_state": nbytes(v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v)),
        "block_bytes": gathered_bytes(bare.blocks[0]),
        "root_bytes": gathered_bytes(bare) - sum(gathered_bytes(b) for b in bare.blocks),
        "model_bytes": gathered_bytes(bare),
    }
    engine.close()
    return result


def plain_save_and_load_refused(path: str) -> list[str]:
    """What dpkit.save_model and dpkit.load_model say to a sharded model (each process holds only its shards)."""
    import dpkit

    engine = Engine(strategy="fsdp", accelerator="cpu", devices=2, progress=False)
    model = engine.setup(Blocks())
    messages = []
    for call in (lambda: dpkit.save_model(model, path), lambda: dpkit.load_model(model, path)):
        try:
            call()
        except ValueError as error:
            messages.append(str(error))
    return messages


def mismatched_resume(state: str) -> dict:
    """fsdp asked to resume a state into a wider model: refused before any shard is read, nothing changed."""
    from dpkit.checkpoint.model_files import CheckpointMismatchError

    engine = Engine(strategy="fsdp", accelerator="cpu", devices=2, progress=False)
    torch.manual_seed(3)
    model = Blocks(width=48)
    model, optimizer = engine.setup(model, torch.optim.Adam(model.parameters(), lr=0.01))
    bare = engine.model_copies()[0][0]
    before = {name: p.detach().to_local().clone() for name, p in bare.named_parameters()}
    try:
        engine.load_state(state)
        message = None
    except CheckpointMismatchError as error:
        message = str(error)
    unchanged = all(torch.equal(p.detach().to_local(), before[n]) for n, p in bare.named_parameters())
    fresh = not any(optimizer.state.values())
    engine.close()
    return {"message": message, "unchanged": unchanged, "optimizer_fresh": fresh, "step": engine.step}
