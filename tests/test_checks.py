import numpy as np
import pytest
import torch

from dpkit.checks import check_dim, check_int, check_int_list


def test_check_int_accepts_ints_and_integral_scalars():
    assert check_int(3, "steps") == 3
    assert check_int(0, "warmup", minimum=0) == 0
    assert check_int(np.int64(4), "n") == 4 and check_int(torch.tensor(5), "n") == 5


@pytest.mark.parametrize(
    "value, error, message",
    [
        (0, ValueError, "steps: expected a positive int (number of steps), got 0"),
        (-1, ValueError, "steps: expected a positive int (number of steps), got -1"),
        (True, TypeError, "steps: expected a positive int (number of steps), got True (bool)"),
        (2.5, TypeError, "steps: expected a positive int (number of steps), got 2.5 (float)"),
        ("3", TypeError, "steps: expected a positive int (number of steps), got '3' (str)"),
    ],
)
def test_check_int_names_argument_value_and_what_is_accepted(value, error, message):
    with pytest.raises(error) as info:
        check_int(value, "steps", meaning="number of steps")
    assert str(info.value) == message


def test_check_int_list_and_dim():
    assert check_int_list((1, 0), "chunk_sizes", length=2) == [1, 0]
    with pytest.raises(ValueError, match=r"chunk_sizes\[1\]: expected a non-negative int, got -1"):
        check_int_list([1, -1], "chunk_sizes")
    with pytest.raises(ValueError, match="has 1 entries where 2 are needed"):
        check_int_list([1], "chunk_sizes", length=2)
    assert check_dim(-1) == -1 and check_dim(-1, 3) == 2
    with pytest.raises(ValueError, match="dim: 3 is out of range for a 3-dim tensor"):
        check_dim(3, 3)
    with pytest.raises(TypeError, match="dim: expected an int"):
        check_dim(1.0)
