"""torch.onnx.export of a model living on openreg, checked against onnxruntime on the CPU.

Needs devipc-openreg's `onnx` extra, which `make setup` installs."""
import numpy as np
import pytest
import torch

ort = pytest.importorskip("onnxruntime", reason="pip install 'devipc-openreg[onnx]'")


class _ConvNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 4, 3)
        self.head = torch.nn.Linear(4 * 6 * 6, 5)

    def forward(self, x):
        return self.head(torch.relu(self.conv(x)).flatten(1))


@pytest.mark.parametrize("dynamo", [True, False], ids=["torch.export", "torchscript"])
def test_a_model_on_openreg_exports_and_onnxruntime_agrees(tmp_path, dynamo):
    torch.manual_seed(0)
    model = _ConvNet().eval().to("openreg")
    x = torch.randn(2, 3, 8, 8, device="openreg")
    path = str(tmp_path / "model.onnx")
    if dynamo:
        torch.onnx.export(model, (x,), dynamo=True, verbose=False).save(path)
    else:
        torch.onnx.export(model, (x,), path, dynamo=False)
    session = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    got = session.run(None, {session.get_inputs()[0].name: x.cpu().numpy()})[0]
    with torch.no_grad():
        expected = model(x).cpu().numpy()
    assert got.shape == (2, 5)
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)
