from collections import namedtuple
from dataclasses import dataclass

import pytest
import torch

from dpkit.parallel.gather import gather

CPU = torch.device("cpu", 0)
Out = namedtuple("Out", "logits aux")


@dataclass
class Result:
    scores: torch.Tensor
    name: str


def test_tensors_concatenate_in_replica_order():
    a, b = torch.ones(2, 3), torch.zeros(1, 3)
    assert torch.equal(gather([a, b], CPU), torch.cat([a, b]))
    assert torch.equal(gather([a.T, b.T], CPU, dim=1), torch.cat([a, b]).T)


def test_structures_are_rebuilt():
    r0 = {"b": Out(torch.ones(1, 2), [torch.ones(1)]), "a": Result(torch.ones(1), "x"), "n": None}
    r1 = {"b": Out(torch.zeros(2, 2), [torch.zeros(2)]), "a": Result(torch.zeros(2), "y"), "n": None}
    merged = gather([r0, r1], CPU)
    assert list(merged) == ["b", "a", "n"]
    assert isinstance(merged["b"], Out) and merged["b"].logits.shape == (3, 2)
    assert isinstance(merged["b"].aux, list) and merged["b"].aux[0].shape == (3,)
    assert isinstance(merged["a"], Result) and merged["a"].scores.shape == (3,)
    assert merged["a"].name == ["x", "y"]
    assert merged["n"] is None


def test_non_tensor_leaves_become_lists_and_strings_stay_whole():
    assert gather([("hello", 3), ("world", 4)], CPU) == (["hello", "world"], [3, 4])


def test_zero_dim_outputs_become_a_vector_with_a_warning():
    with pytest.warns(UserWarning, match="0-dim"):
        merged = gather([torch.tensor(1.0), torch.tensor(2.0), torch.tensor(3.0)], CPU)
    assert torch.equal(merged, torch.tensor([1.0, 2.0, 3.0]))


def test_mismatched_structures_name_path_and_replica():
    with pytest.raises(ValueError, match=r"output\['x'\]: replica 1"):
        gather([{"x": torch.ones(1)}, {"x": "text"}], CPU)
    with pytest.raises(ValueError, match="replica 2 returned keys"):
        gather([{"x": torch.ones(1)}, {"x": torch.ones(1)}, {"y": torch.ones(1)}], CPU)
    with pytest.raises(ValueError, match=r"output\[1\]: replica 1 returned shape \(1, 4\)"):
        gather([(torch.ones(1), torch.ones(1, 3)), (torch.ones(1), torch.ones(1, 4))], CPU)
    with pytest.raises(ValueError, match="replica 1 returned 1 items"):
        gather([(torch.ones(1), torch.ones(1)), (torch.ones(1),)], CPU)
    with pytest.raises(ValueError, match="replica 1 returned None"):
        gather([torch.ones(1), None], CPU)


def test_negative_dim_and_torch_style_target_devices():
    a, b = torch.ones(2, 3), torch.zeros(2, 1)
    assert gather([a, b], CPU, dim=-1).shape == (2, 4)
    assert gather([a, a], -1).shape == (4, 3) and gather([a, a], "cpu").shape == (4, 3)
    with pytest.raises(ValueError, match="no dimension -3"):
        gather([a, a], CPU, dim=-3)


def test_flattened_batch_is_warned_about():
    # an LSTM LM: input (seq=6, batch) split on dim 1 into 4 + 4 rows, output flattened to (seq*rows, vocab)
    outputs = [torch.zeros(24, 100), torch.zeros(24, 100)]
    with pytest.warns(UserWarning, match=r"flattened into dim 0"):
        gather(outputs, CPU, dim=1, rows=[4, 4], input_sizes=[6])
    # uneven rows cannot be concatenated at all; the error says why
    with pytest.raises(ValueError, match=r"outside dim 1; dim 0 \[18, 12\] follows the rows .* flattened into dim 0"):
        gather([torch.zeros(18, 100), torch.zeros(12, 100)], CPU, dim=1, rows=[3, 2])


@pytest.mark.parametrize(
    "outputs, dim, rows, input_sizes",
    [
        ([torch.zeros(6, 4, 100), torch.zeros(6, 4, 100)], 1, [4, 4], [6]),  # batch kept on dim 1
        ([torch.zeros(24, 100), torch.zeros(24, 100)], 0, [4, 4], [6]),  # (batch*seq, vocab) on dim 0: fine
        ([torch.zeros(18, 100), torch.zeros(12, 100)], 0, [3, 2], []),  # the same, uneven
        ([torch.zeros(8, 8), torch.zeros(8, 8)], 0, [4, 4], [5]),  # a fixed-size output, even rows
        ([torch.zeros(3), torch.zeros(3)], 0, [4, 4], [6]),  # a per-replica summary
        ([torch.zeros(4, 12), torch.zeros(4, 12)], 0, [4, 4], [12]),  # ordinary (batch, features)
    ],
)
def test_ordinary_outputs_raise_no_false_alarm(outputs, dim, rows, input_sizes):
    import warnings as warnings_module

    with warnings_module.catch_warnings():
        warnings_module.simplefilter("error")
        gathered = gather(outputs, CPU, dim=dim, rows=rows, input_sizes=input_sizes)
    assert gathered.shape[dim] == sum(o.shape[dim] for o in outputs)
