"""Core SDK calls (create, train, sample, save_state, create-from-state) with whatever tinker SDK
runs it; prints OK lines. tests/e2e/test_older_sdks.py runs it with older releases."""
import sys, os
os.environ.setdefault("TINKER_API_KEY", "tml-probe")
import tinker
from tinker import types
url, base = sys.argv[1], sys.argv[2]
sc = tinker.ServiceClient(base_url=url)
tc = sc.create_lora_training_client(base_model=base, rank=4)
tc = tc.result() if hasattr(tc, "result") else tc
print("OK create", tc.model_id if hasattr(tc, "model_id") else "")
d = types.Datum(model_input=types.ModelInput.from_ints([5, 6, 7, 8]), loss_fn_inputs={"target_tokens": [6, 7, 8, 9], "weights": [1.0] * 4})
for _ in range(3):
    fb = tc.forward_backward([d], "cross_entropy").result()
    tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
print("OK train", fb.metrics)
s = tc.save_weights_and_get_sampling_client()
s = s.result() if hasattr(s, "result") else s
r = s.sample(types.ModelInput.from_ints([5, 6, 7]), 2, types.SamplingParams(max_tokens=4, temperature=1.0)).result()
print("OK sample", [q.tokens for q in r.sequences])
p = tc.save_state("probe").result().path
print("OK save_state", p)
c = sc.create_training_client_from_state(p)
c = c.result() if hasattr(c, "result") else c
print("OK load", c.model_id if hasattr(c, "model_id") else "")
