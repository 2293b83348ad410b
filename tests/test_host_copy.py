"""host_copy: every kind of tensor a state holds comes out bit-exact, whether it went by memcpy
(large, contiguous), by copy_ (small, strided, a conjugate view) or was cut in two between the
caller's thread and the helper's; sizes that do not match fail as copy_ fails; a forked child
copies with a helper of its own."""

from __future__ import annotations

import multiprocessing

import numpy as np
import pytest
import torch

from dcp_tiered import host_copy


def _states() -> dict[str, list[torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    big = host_copy.MEMCPY_MIN_BYTES
    return {
        "many small": [torch.randn(100 + i, generator=g) for i in range(300)],
        "one huge, cut in two": [torch.randn(3 * 2**20 + 1, generator=g)],
        "mixed kinds": [
            torch.randn(big, generator=g).to(torch.bfloat16),
            torch.randn(600, 700, generator=g).t(),  # large but strided: copy_
            torch.randint(0, 2, (big * 3,), generator=g).bool(),
            torch.randn(big, dtype=torch.complex64, generator=g),
            torch.randn(big // 8, dtype=torch.complex64, generator=g).conj(),
            torch._neg_view(torch.randn(big, generator=g)),  # its bytes are not its values
            torch.nn.Parameter(torch.randn(big, generator=g)),  # requires grad
            torch.tensor(3.5),
            torch.empty(0),
        ],
    }


@pytest.mark.parametrize("split_small", [True, False])
@pytest.mark.parametrize("name", list(_states()))
def test_every_kind_of_tensor_is_copied_bit_exact(name, split_small):
    srcs = _states()[name]
    dsts = [torch.full_like(s.detach().resolve_conj().resolve_neg(), 7) for s in srcs]
    host_copy.copy_all(dsts, srcs, split_small=split_small)
    for d, s in zip(dsts, srcs):
        assert torch.equal(d, s.detach().resolve_conj()), (name, s.dtype, s.shape)


def test_a_size_that_does_not_match_fails_and_the_others_are_unharmed():
    srcs = [torch.randn(2**20), torch.randn(10)]
    dsts = [torch.zeros(2**20), torch.zeros(11)]
    with pytest.raises(RuntimeError):
        host_copy.copy_all(dsts, srcs)


def _child(queue) -> None:
    # Built and compared with numpy: torch's own OpenMP ops can hang in a child forked from a
    # process that used them, which is also why host_copy copies large tensors by memcpy.
    arrays = [np.arange(2**20, dtype=np.float32) + i for i in range(8)]
    srcs = [torch.from_numpy(a) for a in arrays]
    dsts = [torch.from_numpy(np.zeros_like(a)) for a in arrays]
    host_copy.copy_all(dsts, srcs)
    queue.put(all(np.array_equal(d.numpy(), a) for d, a in zip(dsts, arrays)))


def test_a_forked_child_copies_with_a_helper_of_its_own():
    srcs = [torch.randn(2**20) for _ in range(4)]
    host_copy.copy_all([torch.empty(2**20) for _ in range(4)], srcs)  # the parent's helper
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    child = ctx.Process(target=_child, args=(queue,))
    child.start()
    assert queue.get(timeout=60) is True
    child.join(60)
    assert child.exitcode == 0
