import torch

from eagle3.extract.shards import HiddenShard, dequantize_fp8, quantize_fp8, read_shard, write_shard


def _shard(t: int = 10, h: int = 8, dtype=torch.bfloat16) -> HiddenShard:
    g = torch.Generator().manual_seed(0)
    return HiddenShard(
        input_ids=torch.arange(t, dtype=torch.int32),
        loss_mask=torch.ones(t, dtype=torch.uint8),
        offsets=torch.tensor([0, 4, t]),
        sample_ids=torch.tensor([7, 3]),
        aux_hidden=torch.randn(t, 3 * h, generator=g).to(dtype),
        final_hidden=torch.randn(t, h, generator=g).to(dtype),
    )


def test_fp8_round_trip_error_is_small_per_layer_scale():
    g = torch.Generator().manual_seed(0)
    # Three aux layers of very different magnitude, as in real targets (late layers grow).
    x = torch.cat([torch.randn(64, 32, generator=g) * s for s in (0.05, 3.0, 400.0)], dim=1)  # [T, 3H]
    q, scale = quantize_fp8(x, groups=3)
    assert q.dtype == torch.float8_e4m3fn and scale.shape == (64, 3) and scale.dtype == torch.float32
    back = dequantize_fp8(q, scale)
    for g_ in range(3):
        part, ref = back[:, g_ * 32 : (g_ + 1) * 32], x[:, g_ * 32 : (g_ + 1) * 32]
        rel = (part - ref).norm() / ref.norm()
        assert rel < 0.05, f"group {g_}: relative error {rel:.3f}"
    # e4m3 keeps 3 mantissa bits: elementwise error within 1/16 of the row's absmax.
    assert ((back - x).abs() <= scale.repeat_interleave(32, dim=1) * 448 / 16 + 1e-6).all()


def test_write_read_round_trip_bf16(tmp_path):
    shard = _shard()
    write_shard(tmp_path / "s.safetensors", shard)
    back = read_shard(tmp_path / "s.safetensors")
    assert back.storage_dtype == "bfloat16" and back.validate(8) == []
    assert torch.equal(back.aux_hidden, shard.aux_hidden) and torch.equal(back.sample_ids, shard.sample_ids)
    assert back.aux_hidden_float().dtype == torch.float32
    assert back.sample(1) == slice(4, 10)


def test_write_read_round_trip_fp8(tmp_path):
    ref = _shard(dtype=torch.float32)
    aux_q, aux_s = quantize_fp8(ref.aux_hidden, groups=3)
    fin_q, fin_s = quantize_fp8(ref.final_hidden, groups=1)
    shard = HiddenShard(ref.input_ids, ref.loss_mask, ref.offsets, ref.sample_ids, aux_q, fin_q, aux_s, fin_s)
    write_shard(tmp_path / "s.safetensors", shard)
    back = read_shard(tmp_path / "s.safetensors")
    assert back.storage_dtype == "float8_e4m3fn" and back.validate(8) == []
    torch.testing.assert_close(back.aux_hidden_float(), ref.aux_hidden, rtol=0.07, atol=0.01)
    torch.testing.assert_close(back.final_hidden_float(), ref.final_hidden, rtol=0.07, atol=0.01)


def test_validate_names_inconsistent_shards():
    bad = _shard()
    bad.final_hidden = bad.final_hidden[:9]
    assert any("token count" in p for p in bad.validate())
    bad = _shard()
    bad.offsets = torch.tensor([0, 4, 9])
    assert any("offsets" in p for p in bad.validate())
    assert any("target hidden size" in p for p in _shard().validate(16))


def test_streamed_safetensors_read_back_with_every_dtype(tmp_path):
    import io

    from safetensors.torch import load

    from eagle3.extract.shards import stream_safetensors

    g = torch.Generator().manual_seed(0)
    tensors = {"bf16": torch.randn(5, 3, generator=g).bfloat16(),
               "fp8": torch.randn(4, 8, generator=g).to(torch.float8_e4m3fn), "f32": torch.randn(7, generator=g), "i64": torch.arange(3), "u8": torch.ones(2, 2, dtype=torch.uint8),
               "empty": torch.zeros(0, 4), "scalar": torch.tensor(2.5)}
    buf = io.BytesIO()
    n = stream_safetensors(buf, tensors, {"format": "test"})
    assert n == len(buf.getvalue())
    back = load(buf.getvalue())
    assert set(back) == set(tensors)
    for k, v in tensors.items():
        assert back[k].dtype == v.dtype and back[k].shape == v.shape, k
        assert torch.equal(back[k].reshape(-1).view(torch.uint8), v.reshape(-1).view(torch.uint8)), k  # bit for bit
