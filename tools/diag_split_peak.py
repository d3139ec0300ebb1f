"""Where the device peak of a streamed split load goes (GPU): per module tensor put, the peak above the memory
held before its source tensor was read; writes $OUT/split_peak.json."""
import json, os, subprocess, sys
import torch
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "src"))
from diffusers import ZImageTransformer2DModel  # noqa
from diffgraph.models import split_stream
out = os.environ.get("OUT", "/tmp")
path = "/tmp/z_bench.safetensors"
subprocess.run([sys.executable, os.path.join(ROOT, "tools", "bench_split_load.py"), "--file", path, "--gb", "0.4",
                "--dim", "1024", "--write-only"], check=True)
dev = torch.device("cuda")
torch.zeros(1, device=dev); torch.cuda.synchronize()
start = torch.cuda.memory_allocated()
events = []
orig_put, orig_fin, orig_check = split_stream._put, split_stream._finished, split_stream._check_places
def mark(what):
    torch.cuda.synchronize()
    events.append(dict(what=what, held=torch.cuda.memory_allocated() - start, peak=torch.cuda.max_memory_allocated() - start))
    torch.cuda.reset_peak_memory_stats()
def put(model, kept, name, value, scale, dtype, keep_fp8):
    mark("before put " + name + f" {tuple(value.shape)} {value.dtype} contig={value.is_contiguous()}")
    orig_put(model, kept, name, value, scale, dtype, keep_fp8)
    mark("after put " + name)
def fin(*a):
    mark("before finished")
    r = orig_fin(*a)
    mark("after finished")
    return r
def check(*a):
    mark("built")
    return orig_check(*a)
split_stream._put, split_stream._finished, split_stream._check_places = put, fin, check
torch.cuda.reset_peak_memory_stats()
model, _ = split_stream.load_transformer(path, torch.bfloat16, dev)
mark("end")
module = sum(t.numel() * t.element_size() for t in model.state_dict().values())
overall = max(e["peak"] for e in events)
worst = sorted(events, key=lambda e: e["peak"] - e["held"], reverse=True)[:8]
bufs = [(n, tuple(b.shape), str(b.dtype), str(b.device)) for n, b in model.named_buffers()]
res = dict(module=module, overall_peak=overall, over=overall - module, worst=worst,
           at_peak=[e for e in events if e["peak"] == overall], buffers=bufs[:20], n_events=len(events),
           last=events[-6:])
json.dump(res, open(os.path.join(out, "split_peak.json"), "w"), indent=1)
print(json.dumps(res, indent=1)[:5000])
