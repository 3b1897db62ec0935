import keel, torch, time, cProfile, pstats, io, sys
from keel.model import ModelConfig, TransformerLM
from keel.train.optim import build_optimizer
from keel.train.config import OptimConfig
from keel.train.step import TrainStep
torch.set_num_threads(1)
def make(n):
    cfg = ModelConfig(vocab_size=256, d_model=32, n_blocks=n//2, n_heads=4, n_kv_heads=2, d_ffn=96, max_seq_len=16)
    torch.manual_seed(0); m = TransformerLM(cfg); opt = build_optimizer(m, OptimConfig())
    ids = torch.randint(0,256,(1,17)); st = TrainStep(m, opt)
    return st, (lambda: (ids[:,:-1], ids[:,1:]))
for n in (128, 1024):
    st, nb = make(n)
    for _ in range(2): st(nb, 1e-3)
    t=time.perf_counter(); 
    for _ in range(5): st(nb, 1e-3)
    dt=(time.perf_counter()-t)/5
    pr=cProfile.Profile(); pr.enable(); st(nb,1e-3); pr.disable()
    s=io.StringIO(); pstats.Stats(pr,stream=s).sort_stats("tottime").print_stats(12)
    print(n, "ms/sublayer", 1e3*dt/n); print("\n".join(s.getvalue().splitlines()[6:22]))
    del st
