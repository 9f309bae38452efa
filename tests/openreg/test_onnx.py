"""torch.onnx.export of a model living on openreg, checked against onnxruntime on the CPU.

Needs devipc-openreg's `onnx` extra, which `make setup` installs. Each export runs in a fresh
interpreter: the exporter keeps the model's device tensors in state of its own after it returned,
which would hold openreg memory that later tests expect to be given back."""

import textwrap

import pytest
from _support import json_of

pytest.importorskip("onnxruntime", reason="pip install 'devipc-openreg[onnx]'")

EXPORT = """
import json, os, sys, tempfile
import numpy as np, onnxruntime as ort, torch

class ConvNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 4, 3)
        self.head = torch.nn.Linear(4 * 6 * 6, 5)

    def forward(self, x):
        return self.head(torch.relu(self.conv(x)).flatten(1))

torch.manual_seed(0)
model = ConvNet().eval().to("openreg")
x = torch.randn(2, 3, 8, 8, device="openreg")
path = os.path.join(tempfile.mkdtemp(), "model.onnx")
if {dynamo}:
    torch.onnx.export(model, (x,), dynamo=True, verbose=False).save(path)
else:
    torch.onnx.export(model, (x,), path, dynamo=False)
session = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
got = session.run(None, {{session.get_inputs()[0].name: x.cpu().numpy()}})[0]
with torch.no_grad():
    expected = model(x).cpu().numpy()
print(json.dumps({{"shape": list(got.shape), "device": str(next(model.parameters()).device),
                  "diff": float(np.abs(got - expected).max())}}))
"""


@pytest.mark.parametrize("dynamo", [True, False], ids=["torch.export", "torchscript"])
def test_a_model_on_openreg_exports_and_onnxruntime_agrees(dynamo):
    out = json_of(textwrap.dedent(EXPORT.format(dynamo=dynamo)))
    assert out["device"] == "openreg:0" and out["shape"] == [2, 5]
    assert out["diff"] < 1e-5, out
