# engines/weight_channel.py: the trainer's weights to an engine in another process, over a two-rank gloo group. The whole
# push through an engine actor, its weights landing bit for bit, is in tests/test_runtime.py (the straddling update).
import threading

import torch

from engines import weight_channel


def test_the_weight_channel_keeps_every_dtype_and_name_bit_for_bit():
    """Two ranks of a gloo channel (threads here; a trainer and an engine actor in a run): a state dict of mixed
    dtypes crosses in dtype-faithful buckets, each tensor equal bit for bit, with its dtype and shape. Small
    buckets split a dtype's tensors over several; an oversized tensor travels alone."""
    generator = torch.Generator().manual_seed(0)
    state = {"embed.weight": torch.randn(50, 8, generator=generator),
             "router.weight": torch.randn(4, 8, generator=generator).to(torch.bfloat16),
             "norm.weight": torch.randn(8, generator=generator).to(torch.bfloat16),
             "big.weight": torch.randn(300, generator=generator),
             "steps": torch.tensor([3, 1 << 40]),
             "scale": torch.randn(3, 3, generator=generator).to(torch.float16)}
    plan = weight_channel.weight_plan(state, bucket_bytes=512)
    assert all(len({dtype for _, dtype, _ in bucket}) == 1 for bucket in plan)        # one dtype per bucket
    assert sorted(name for bucket in plan for name, _, _ in bucket) == sorted(state)   # every name, once
    assert [name for name, _, _ in next(b for b in plan if b[0][0] == "big.weight")] == ["big.weight"]
    assert len(plan) > len({t.dtype for t in state.values()})                          # a dtype split in two
    port, received = weight_channel.free_port(), {}

    def engine_end():
        group = weight_channel.open_group("127.0.0.1", port, 1, "gloo", 60)
        received.update(weight_channel.receive_state(group, plan, "cpu"))
    engine = threading.Thread(target=engine_end)
    engine.start()
    weight_channel.send_state(weight_channel.open_group("127.0.0.1", port, 0, "gloo", 60), state, plan, "cpu")
    engine.join(timeout=60)
    assert received.keys() == state.keys()
    for name, tensor in state.items():
        assert received[name].dtype == tensor.dtype and received[name].shape == tensor.shape
        assert torch.equal(received[name], tensor), name
