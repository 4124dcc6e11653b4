"""cadlib.infra.results.calibration_file: the committed calibration of this machine's GPU, by its name."""
from cadlib.analysis.whatif import gpu_table
from cadlib.infra.results import RESULTS_DIR, calibration_file


def test_the_committed_h200_calibration_is_found_by_the_gpu_name():
    found = calibration_file(device="1x NVIDIA H200")
    assert found == RESULTS_DIR / "calibration_h200.json"
    assert gpu_table.load(found, model="llama3-8b").device          # a calibration the what-if reads
    assert calibration_file(device="8x NVIDIA H200 NVL") == found   # a word of the name is enough


def test_no_calibration_on_a_cpu_or_for_an_uncalibrated_gpu(tmp_path):
    assert calibration_file(device="CPU: AMD EPYC (2 cores)") is None
    assert calibration_file(device="1x NVIDIA A100-SXM4-80GB") is None
    (tmp_path / "calibration_a100_sxm4_80gb.json").write_text("{}")
    found = calibration_file(tmp_path, "1x NVIDIA A100-SXM4-80GB")
    assert found == tmp_path / "calibration_a100_sxm4_80gb.json"
    assert calibration_file(tmp_path) is None                         # this machine: a CPU, or no file here
