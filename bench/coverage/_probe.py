import hashlib, json, os, sys
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.getcwd())
import torch
from architectures import build
from google.protobuf import json_format
from torchfarm.compiler import serialize
from torchfarm.compiler.target import local_target
from torchfarm.compiler import trace_state

def capture(model, inputs):
    got = {}
    def cap(gm, ex):
        got["p"] = serialize.dumps(gm); got["state"] = json_format.MessageToDict(trace_state.capture())
        return gm.forward
    torch._dynamo.reset()
    m = torch.compile(model, backend=cap)
    model.eval()
    with torch.no_grad():
        m(*inputs)
    return got

model, inputs = build("bert", "cuda", "large")
print("target0", json_format.MessageToDict(local_target("cuda")))
a = capture(model, inputs)
print("A", hashlib.sha256(a["p"]).hexdigest()[:16], a["state"])
torch._dynamo.reset()
c = torch.compile(model)
with torch.no_grad():
    c(*inputs)
print("target1", json_format.MessageToDict(local_target("cuda")))
b = capture(model, inputs)
print("B", hashlib.sha256(b["p"]).hexdigest()[:16], b["state"])
out = os.environ.get("OUT", "/tmp")
open(f"{out}/a.bin", "wb").write(a["p"]); open(f"{out}/b.bin", "wb").write(b["p"])
