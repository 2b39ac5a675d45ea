

def test_oom_sizes_reads_the_sizes_a_cuda_message_states():
    from systems.measure.devices import oom_sizes

    message = ("CUDA out of memory. Tried to allocate 512.00 MiB. GPU 0 has a total capacity of 79.19 GiB of which "
               "300.50 MiB is free. Of the allocated memory 70.00 GiB is allocated by PyTorch, and 1.25 GiB is "
               "reserved by PyTorch but unallocated.")
    assert oom_sizes(message) == {"requested_bytes": 512 * 2**20, "device_free_bytes": round(300.5 * 2**20),
                                  "allocated_bytes": 70 * 2**30, "reserved_unallocated_bytes": round(1.25 * 2**30)}
    assert oom_sizes("RuntimeError: out of memory") == {} and oom_sizes(None) == {}


def test_only_an_allocation_failure_is_an_out_of_memory_point():
    import pytest
    import torch

    from systems.measure.devices import catch_oom, is_oom

    assert is_oom(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    assert is_oom(RuntimeError("CUDA error: out of memory"))  # older allocator paths
    # NCCL failing for its own buffers leaves the process group unusable: the error propagates
    nccl = torch.distributed.DistBackendError("NCCL error: unhandled system error: out of memory")
    assert not is_oom(nccl) and not is_oom(ValueError("bad shape"))
    with catch_oom() as oom:
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.00 GiB")
    assert oom.message.startswith("CUDA out of memory")
    with pytest.raises(torch.distributed.DistBackendError), catch_oom():  # not swallowed as a point
        raise nccl
