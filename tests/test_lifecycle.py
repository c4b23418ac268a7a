"""`rtrl up` housekeeping."""


def test_up_clears_the_previous_run_but_keeps_the_warm_start_cache(tmp_path):
    from rtrl.lifecycle import clear_previous_run

    (tmp_path / "cache").mkdir()
    (tmp_path / "cache" / "warmstart-x.safetensors").write_bytes(b"w")
    (tmp_path / "chdb").mkdir()
    (tmp_path / "chdb" / "data").write_bytes(b"old rows")
    (tmp_path / "stack.json").write_text("{}")
    clear_previous_run(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cache"]
    assert (tmp_path / "cache" / "warmstart-x.safetensors").exists()
