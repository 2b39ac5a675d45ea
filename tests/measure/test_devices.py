

def test_oom_sizes_reads_the_sizes_a_cuda_message_states():
    from systems.measure.devices import oom_sizes

    message = ("CUDA out of memory. Tried to allocate 512.00 MiB. GPU 0 has a total capacity of 79.19 GiB of which "
               "300.50 MiB is free. Of the allocated memory 70.00 GiB is allocated by PyTorch, and 1.25 GiB is "
               "reserved by PyTorch but unallocated.")
    assert oom_sizes(message) == {"requested_bytes": 512 * 2**20, "device_free_bytes": round(300.5 * 2**20),
                                  "allocated_bytes": 70 * 2**30, "reserved_unallocated_bytes": round(1.25 * 2**30)}
    assert oom_sizes("RuntimeError: out of memory") == {} and oom_sizes(None) == {}
