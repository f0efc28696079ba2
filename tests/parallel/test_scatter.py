from collections import namedtuple
from dataclasses import dataclass

import pytest
import torch

from dpkit.parallel.scatter import Broadcast, batch_size_of, plan_split, scatter, split_sizes

Pair = namedtuple("Pair", "left right")


@dataclass
class Batch:
    features: torch.Tensor
    label: str


@pytest.mark.parametrize(
    "batch, n, expected",
    [
        (10, 4, [3, 3, 2, 2]),
        (36, 7, [6, 5, 5, 5, 5, 5, 5]),
        (8, 4, [2, 2, 2, 2]),
        (2, 4, [1, 1, 0, 0]),
        (1, 1, [1]),
    ],
)
def test_split_sizes_differ_by_at_most_one(batch, n, expected):
    sizes = split_sizes(batch, n)
    assert sizes == expected
    assert sum(sizes) == batch and max(sizes) - min(sizes) <= 1


def test_every_split_has_the_balance_property():
    for batch in range(1, 40):
        for n in range(1, 9):
            sizes = split_sizes(batch, n)
            assert sum(sizes) == batch and max(sizes) - min(sizes) <= 1
            assert sorted(sizes, reverse=True) == sizes


def test_mismatched_batch_sizes_name_the_paths():
    with pytest.raises(ValueError) as info:
        batch_size_of((torch.zeros(4, 2), torch.zeros(5, 2)), {"mask": torch.zeros(4)}, 0)
    message = str(info.value)
    assert "args[0]=4" in message and "args[1]=5" in message and "kwargs['mask']=4" in message


def test_nested_paths_are_checked_too():
    args = ({"x": [torch.zeros(3), Pair(torch.zeros(3), torch.zeros(2))]},)
    with pytest.raises(ValueError, match=r"args\[0\]\['x'\]\[1\]\.right=2"):
        batch_size_of(args, {}, 0)
    with pytest.raises(ValueError, match=r"kwargs\['b'\]\.features=7"):
        batch_size_of((torch.zeros(6),), {"b": Batch(torch.zeros(7), "s")}, 0)


def test_zero_dim_tensor_needs_broadcast():
    with pytest.raises(ValueError, match=r"args\[1\].*dpkit.Broadcast"):
        batch_size_of((torch.zeros(4), torch.tensor(2.0)), {}, 0)
    with pytest.raises(ValueError, match=r"kwargs\['w'\].*Broadcast"):
        batch_size_of((torch.zeros(4, 3),), {"w": torch.zeros(4)}, 1)
    assert batch_size_of((torch.zeros(4), Broadcast(torch.tensor(2.0))), {}, 0) == 4


def test_empty_batch_and_nothing_to_split():
    with pytest.raises(ValueError, match="empty batch"):
        batch_size_of((torch.zeros(0, 3),), {}, 0)
    assert batch_size_of((1, "a", None), {"k": Broadcast(torch.ones(2))}, 0) is None


def test_chunk_sizes_must_sum_to_batch():
    with pytest.raises(ValueError, match="sum to 9 but the batch has 10"):
        plan_split(10, 3, [3, 3, 3])
    assert plan_split(10, 3, [0, 4, 6]).offsets == [0, 0, 4]


def test_scatter_slices_nested_inputs_and_keeps_non_tensors():
    devices = [torch.device("cpu", i) for i in range(3)]
    x = torch.arange(10).float().unsqueeze(1)
    scale = torch.tensor(3.0)
    args = (Pair(x, [x * 2, "tag"]), Batch(x + 1, "label"))
    kwargs = {"scale": Broadcast(scale), "flag": True, "nothing": None}
    plan = plan_split(10, 3)
    chunks = scatter(args, kwargs, plan, devices, 0)
    assert [device for device, _, _ in chunks] == devices
    rows = [0, 4, 7, 10]
    for i, (_, a, k) in enumerate(chunks):
        assert isinstance(a[0], Pair) and isinstance(a[1], Batch)
        assert torch.equal(a[0].left, x[rows[i] : rows[i + 1]])
        assert torch.equal(a[0].right[0], 2 * x[rows[i] : rows[i + 1]])
        assert a[0].right[1] == "tag" and a[1].label == "label"
        assert torch.equal(a[1].features, x[rows[i] : rows[i + 1]] + 1)
        assert torch.equal(k["scale"], scale) and k["flag"] is True and k["nothing"] is None


def test_scatter_skips_devices_with_no_rows():
    devices = [torch.device("cpu", i) for i in range(3)]
    chunks = scatter((torch.arange(5),), {}, plan_split(5, 3, [0, 5, 0]), devices, 0)
    assert [device for device, _, _ in chunks] == [devices[1]]
    assert torch.equal(chunks[0][1][0], torch.arange(5))


def test_scatter_along_another_dim():
    x = torch.arange(12).reshape(2, 6)
    chunks = scatter((x,), {}, plan_split(6, 2), [torch.device("cpu", 0), torch.device("cpu", 1)], 1)
    assert torch.equal(chunks[0][1][0], x[:, :3]) and torch.equal(chunks[1][1][0], x[:, 3:])


def test_broadcast_rejects_non_tensors():
    with pytest.raises(TypeError, match="Broadcast"):
        Broadcast(3)


def test_negative_dim_counts_from_each_tensors_end():
    x = torch.arange(12).reshape(2, 6)
    assert batch_size_of((x,), {}, -1) == 6
    with pytest.raises(ValueError, match="no batch dimension -3"):
        batch_size_of((x,), {}, -3)


def test_torch_signature_scatter_splits_like_torch():
    from dpkit.parallel import scatter as torch_style_scatter
    from dpkit.parallel import scatter_kwargs

    x = torch.arange(10).reshape(5, 2)
    parts = torch_style_scatter((x, "tag", {"y": x + 1}), [0, 1] if False else ["cpu:0", "cpu:1"])
    assert len(parts) == 2 and parts[0][1] == "tag"
    assert torch.equal(parts[0][0], x[:3]) and torch.equal(parts[1][2]["y"], x[3:] + 1)
    assert [p.shape[0] for p in torch_style_scatter(x, dpkit_devices(3), dim=0)] == [2, 2, 1]
    assert [p.shape[1] for p in torch_style_scatter(x, dpkit_devices(2), dim=-1)] == [1, 1]
    assert len(torch_style_scatter(torch.zeros(1, 2), dpkit_devices(3))) == 1  # fewer rows than devices
    assert torch_style_scatter(("a", 1), dpkit_devices(2)) == [("a", 1), ("a", 1)]
    args, kwargs = scatter_kwargs((x,), {"mask": x > 3, "flag": True}, dpkit_devices(2))
    assert len(args) == len(kwargs) == 2 and kwargs[1]["flag"] is True
    assert torch.equal(kwargs[1]["mask"], x[3:] > 3)
    assert scatter_kwargs((), None, dpkit_devices(2)) == ((), ())
    with pytest.raises(ValueError, match=r"inputs\[1\]=4"):  # dpkit's strictness stays on
        torch_style_scatter((x, torch.zeros(4)), dpkit_devices(2))


def dpkit_devices(n):
    return [torch.device("cpu", i) for i in range(n)]


def test_chunk_sizes_are_validated_once_with_one_line_messages():
    from dpkit.parallel.scatter import check_chunk_sizes

    assert check_chunk_sizes(None, 2) is None and check_chunk_sizes((0, 3), 2) == [0, 3]
    with pytest.raises(ValueError, match="chunk_sizes: has 3 entries where 2 are needed"):
        check_chunk_sizes([1, 2, 3], 2)
    with pytest.raises(ValueError, match=r"chunk_sizes\[1\]: expected a non-negative int, got -2"):
        check_chunk_sizes([1, -2], 2)
    with pytest.raises(TypeError, match=r"chunk_sizes\[0\]"):
        check_chunk_sizes([1.5, 2], 2)
    with pytest.raises(ValueError, match="all entries are 0"):
        check_chunk_sizes([0, 0], 2)
    with pytest.raises(TypeError, match="chunk_sizes: expected a list"):
        check_chunk_sizes("12", 2)


class Features(dict):
    """A dict subclass nobody registered with torch.utils._pytree: still walked into and rebuilt."""


def test_unregistered_container_subclasses_are_split_and_rebuilt():
    x = torch.arange(6).reshape(3, 2)
    chunks = scatter((Features(ids=x, name="n", missing=None),), {}, plan_split(3, 2), dpkit_devices(2), 0)
    first = chunks[0][1][0]
    assert (
        type(first) is Features
        and torch.equal(first["ids"], x[:2])
        and first["name"] == "n"
        and first["missing"] is None
    )
    with pytest.raises(ValueError, match=r"args\[0\]\['ids'\]=3, args\[1\]=2"):
        batch_size_of((Features(ids=x), torch.zeros(2)), {}, 0)
