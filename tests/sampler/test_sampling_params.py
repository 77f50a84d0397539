"""sampler_service/convert.sampling_params: the SDK's sampling parameters as vLLM's."""

from sampler_service.convert import sampling_params
from tinkerd.v1 import sampler_pb2


def _params(**fields):
    return sampling_params(sampler_pb2.SampleRequest(params=sampler_pb2.SamplingParams(max_tokens=4, top_p=1.0,
                                                                                      **fields)))


def test_top_k_1_is_greedy_so_a_tie_for_the_maximum_is_no_coin_toss():
    p = _params(temperature=1.0, top_k=1)
    assert p.temperature == 0.0 and p.top_k in (0, -1)
    other = _params(temperature=0.7, top_k=5)
    assert other.temperature == 0.7 and other.top_k == 5
    assert _params(temperature=1.0, top_k=0).top_k in (0, -1)
