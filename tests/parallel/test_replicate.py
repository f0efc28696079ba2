import torch
from torch import nn

from dpkit.parallel.replicate import replicate, replicate_to

CPU0, CPU1 = torch.device("cpu", 0), torch.device("cpu", 1)


class Shared(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(3, 3)
        self.b = self.a  # the same submodule twice
        self.register_buffer("steps", torch.zeros(1))


def test_primary_replica_is_the_module_and_others_are_copies():
    module = Shared()
    replicas = replicate(module, [CPU0, CPU1], CPU0)
    assert replicas[0] is module
    copy = replicas[1]
    assert copy is not module and copy.a is copy.b  # sharing kept
    assert copy.a.weight is not module.a.weight and torch.equal(copy.a.weight, module.a.weight)
    assert copy.steps.data_ptr() != module.steps.data_ptr()


def test_replica_gradients_flow_back_to_the_original_parameters():
    module = nn.Linear(3, 2)
    copy = replicate_to(module, CPU1)
    x = torch.randn(4, 3)
    copy(x).sum().backward()
    expected = torch.autograd.grad(module(x).sum(), module.weight)[0]
    assert torch.allclose(module.weight.grad, expected)


def test_buffer_updates_in_a_copy_do_not_touch_the_original():
    module = nn.BatchNorm1d(2)
    copy = replicate_to(module, CPU1)
    copy(torch.randn(6, 2))
    assert torch.equal(module.running_mean, torch.zeros(2)) and not torch.equal(copy.running_mean, torch.zeros(2))


def test_rnn_replicas_run_and_match():
    torch.manual_seed(0)
    rnn = nn.GRU(4, 5, batch_first=True)
    copy = replicate_to(rnn, CPU1)
    x = torch.randn(2, 3, 4)
    assert torch.allclose(copy(x)[0], rnn(x)[0])


def test_replicating_under_no_grad_makes_no_graph():
    module = nn.Linear(2, 2)
    with torch.no_grad():
        copy = replicate_to(module, CPU1)
    assert not copy.weight.requires_grad
