"""One rank of a multi-process test (launched by flexshard_ranks.run_ranks): init gloo, run, report, exit."""
import importlib.util
import os
import pickle
import sys
import traceback
from pathlib import Path

path, fn_name, rank, world, init_method, out, backend = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5], Path(sys.argv[6]), sys.argv[7]

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

torch.set_num_threads(1)
sys.path.insert(0, str(Path(path).parent))
code = 0
try:
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world)  # a file:// URL
    spec = importlib.util.spec_from_file_location(f"flexshard_rank_test_{Path(path).stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    kwargs = pickle.loads((out / "kwargs.pkl").read_bytes())
    result = getattr(module, fn_name)(rank, world, **kwargs)
    (out / f"{rank}.pkl").write_bytes(pickle.dumps(result))
except BaseException:
    (out / f"{rank}.err").write_text(traceback.format_exc())
    code = 1
finally:
    if dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:
            pass
    sys.stdout.flush()
    os._exit(code)
