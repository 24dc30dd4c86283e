"""benchmarks/profiles/matmul_table.py on the CPU: one row per projection the layers run (and the LM head), each
reading its weight stack's bytes, timed."""
import json
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks",
                                "profiles"))


@pytest.mark.parametrize("quantization", [None, "fp8"])
def test_matmul_table(tmp_path, capsys, quantization):
    import jax
    import matmul_table
    from conftest import random_model
    model = random_model(0)
    argv = ["--rows", "1", "2", "--inner", "2", "--repeats", "1", "--json", str(tmp_path / "t.json")]
    result = matmul_table.main(argv + (["--quantization", quantization] if quantization else []), model=model)
    params = result_params = model.params   # the projections run the engine's weights: FP8 ones where asked
    if quantization:
        from jaxspec.sched.build import quantized_target
        result_params = quantized_target(model, quantization).params
    layers = result_params["layers"]["attention"]
    names = [c.name for c in matmul_table.LAYER_CALLS["attention"]]
    assert set(names) <= set(params["layers"]["attention"])
    head = "lm_head" if "lm_head" in params else "embed"
    for rows in (1, 2):
        entries = result["tables"][rows]
        assert [e["name"] for e in entries] == names + [head]
        for e in entries:
            stack = layers if e["name"] in layers else result_params
            expected = stack[e["name"]].nbytes + (stack[e["name"] + "_scale"].nbytes
                                                  if e["name"] + "_scale" in stack else 0)
            assert e["bytes"] == expected, e
            assert e["seconds"] > 0 and e["tb_per_s"] > 0 and e["of_bandwidth"] > 0
            assert e["layers"] == (model.config.num_layers if e["name"] in layers else 1)
    assert result["step_weight_bytes"] == sum(x.nbytes for x in jax.tree_util.tree_leaves(result_params))
    assert "| 2 | **total**" in capsys.readouterr().out
    assert json.loads((tmp_path / "t.json").read_text())["tables"]["1"][0]["name"] == names[0]
