"""Hardware profiles: presets, TOML files, and a source for every number."""
import dataclasses

import pytest

from ascend_emu import ArgumentError, HardwareProfile, cloudmatrix384
from ascend_emu.profile import PRESETS, SOURCES, ascend910b, load_profile


def test_every_field_names_its_source():
    fields = [f.name for f in dataclasses.fields(HardwareProfile)]
    assert [f for f in fields if f not in SOURCES] == []
    assert [k for k in SOURCES if k not in fields] == []
    # fitted and estimated values say so
    assert SOURCES["l2_gbps"].startswith("fit") and SOURCES["remote_outstanding_bytes"].startswith("estimate")


def test_cloudmatrix_die_follows_its_platform_file():
    p = cloudmatrix384()
    assert (p.soc_version, p.clock_ghz, p.l2_bytes, p.aic_per_die, p.aiv_per_die) == \
        ("Ascend910_9391", 1.85, 201326592, 24, 48)
    assert (p.hbm_read_bytes_per_cycle, p.l2_read_bytes_per_cycle, p.l2_write_bytes_per_cycle) == (32, 110, 86)
    assert (p.l1_to_l0a_bytes_per_cycle, p.l1_to_l0b_bytes_per_cycle, p.ub_to_l2_bytes_per_cycle) == (512, 256, 64)


def test_ascend910b_preset():
    p = ascend910b()
    assert (p.soc_version, p.clock_ghz, p.dies, p.dies_per_chip) == ("Ascend910B2C", 1.8, 8, 1)
    assert p.peak_cube_tflops("int8") == pytest.approx(24 * 16 * 32 * 16 * 2 * 1.8e9 / 1e12)
    with pytest.raises(ValueError, match="1..8"):
        ascend910b(dies=16)


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_toml_round_trip(tmp_path, name):
    p = PRESETS[name]().replace(hbm_gbps=1234.5, l2_bytes=96 << 20)
    path = tmp_path / "p.toml"
    text = p.to_toml(path)
    assert "l2_size=201326592" in text                    # sources travel as comments
    assert HardwareProfile.from_toml(path) == p
    assert load_profile(str(path)) == p


def test_toml_overrides_a_preset(tmp_path):
    path = tmp_path / "small.toml"
    path.write_text('preset = "ascend910b"\nhbm_gbps = 1200\nname = "mine"\n')
    p = HardwareProfile.from_toml(path)
    assert p == ascend910b().replace(hbm_gbps=1200.0, name="mine")


@pytest.mark.parametrize("text, match", [
    ("hbm_gbs = 1.0\n", "unknown key 'hbm_gbs'"),
    ('dies = "many"\n', "dies = 'many' must be of type int"),
    ("dies = 1.5\n", "must be of type int"),
    ('preset = "tpu"\n', "preset='tpu'"),
    ("dies = \n", "not valid TOML"),
])
def test_bad_profile_files_name_the_key(tmp_path, text, match):
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(ArgumentError, match=match):
        HardwareProfile.from_toml(path)


def test_load_profile_by_name_and_errors(tmp_path):
    assert load_profile("cloudmatrix384") == cloudmatrix384()
    assert load_profile(None) == cloudmatrix384()
    assert load_profile("ascend910b") == ascend910b()
    with pytest.raises(ArgumentError, match="not a preset"):
        load_profile("nope")
    with pytest.raises(ArgumentError, match="does not exist"):
        load_profile(str(tmp_path / "missing.toml"))


def test_load_profile_cuts_the_pod_to_the_dies_asked_for(tmp_path):
    assert load_profile(None, 4) == cloudmatrix384(dies=4)
    assert load_profile("ascend910b", 8) == ascend910b()
    path = tmp_path / "p.toml"
    path.write_text("dies = 2\n")
    assert load_profile(str(path), 2).dies == 2
    for spec, dies, limit in ((None, 769, "1..768"), ("ascend910b", 9, "1..8"), (str(path), 3, "1..2"),
                              (None, 0, "1..768")):
        with pytest.raises(ArgumentError, match=f"dies={dies} out of range: profile .* has {limit} dies"):
            load_profile(spec, dies)
