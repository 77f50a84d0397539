"""Every field of every request the tinker SDK in .venv (0.38) can send is honoured or refused,
never silently dropped (docs/compatibility.md, "What SDK 0.38 asks for that is refused").

The SDK's request models (`tinker.types.*Request`, pydantic) are walked field by field, into the
models their fields hold (LoraConfig, SamplingParams, prompt chunks, optimizer configs...). Each
field must be one of:

- honoured: a field of our model of that body (gateway/protocol.py), under its name or an alias;
- refused: in our model's `refused` (protocol.NotServed), so a request that asks for it is a 400
  that names it (checked here on the models and, through HTTP, in tests/e2e/test_wire_refusals.py);
- informational or pending: listed below, with why accepting it changes nothing the caller asked
  for, or which change will serve it.

A new SDK release's new field fails this test until it is put in one of them. The forward_backward
body is protobuf (gateway/tinker_wire.proto): every field the SDK's message can carry is parsed
by ours (same number and type), so none is skipped as unknown."""

from __future__ import annotations

import datetime
import inspect
import re
import typing

import pydantic
import pytest
import tinker
from tinker import types as sdk
from tinker.proto import tinker_public_pb2

from gateway import custom_losses, protocol, tinker_wire_pb2
from gateway.routes import ROUTERS
from gateway.routes.legacy import UnloadModelRequest
from gateway.routes.service import CLIENT_CONFIG

# The SDK's request -> our model of its JSON body.
SERVED = {
    "CreateSessionRequest": protocol.CreateSessionRequest,
    "SessionHeartbeatRequest": protocol.SessionHeartbeatRequest,
    "CreateModelRequest": protocol.CreateModelRequest,
    "GetInfoRequest": protocol.ModelIdRequest,
    "UnloadModelRequest": UnloadModelRequest,
    "OptimStepRequest": protocol.OptimStepRequest,
    "SaveWeightsForSamplerRequest": protocol.SaveWeightsForSamplerRequest,
    "SaveWeightsRequest": protocol.SaveWeightsRequest,
    "SaveWeightsExternalRequest": protocol.SaveWeightsRequest,
    "LoadWeightsRequest": protocol.LoadWeightsRequest,
    "CopyWeightsRequest": protocol.CopyWeightsRequest,
    "CreateSamplingSessionRequest": protocol.CreateSamplingSessionRequest,
    "SampleRequest": protocol.SampleRequest,
    "FutureRetrieveRequest": protocol.RetrieveFutureRequest,
    "JoinSamplingSessionRequest": protocol.JoinSamplingSessionRequest,
    "FuturesRetrieveRequest": protocol.RetrieveFuturesRequest,
    "CreateCustomLossRequest": custom_losses.CreateCustomLossRequest,
    "SessionSearchRequest": protocol.SessionSearchRequest,
    "GetBillingUsageRequest": protocol.UsageWindow,                       # query parameters, not a body
    "GetCurrentCheckpointStorageUsageRequest": protocol.StorageQuery,     # as above
}

# The SDK's model inside a served field -> ours.
NESTED = {
    "LoraConfig": protocol.LoraConfig,
    "SamplingParams": protocol.SamplingParams,
    "ModelInput": protocol.ModelInput,
    "EncodedTextChunk": protocol.PromptChunk,
    "AdamParams": protocol.AdamParams,
    "DimuonParams": protocol.DimuonParams,
    "OptimParamsBase": protocol.AdamParams,        # any other type: convert.adam_params refuses it by name
    "AdamOptimizerConfig": protocol.OptimizerConfig,
    "DimuonOptimizerConfig": protocol.OptimizerConfig,
    "OptimizerConfigBase": protocol.OptimizerConfig,       # an unknown type is a 400 (a Literal)
    "SamplingSessionFuturesTarget": protocol.SamplingSessionTarget,
    "OwnSearchOwner": protocol.OwnSearchOwner,
    "AccessibleSearchOwner": protocol.AccessibleSearchOwner,
    "UserSearchOwner": protocol.UserSearchOwner,
    "SessionSearchCursor": protocol.SearchCursor,
    "ActiveSessionStatusQuery": protocol.StatusQuery,
    "CancelledSessionStatusQuery": protocol.StatusQuery,
    "FailedSessionStatusQuery": protocol.StatusQuery,
    "ClientFinishedSessionStatusQuery": protocol.StatusQuery,
    "TensorData": protocol.TargetTokens,           # SampleRequest.target_prompt_logprobs
}

# SDK models taken as a whole by code other than a pydantic model, which reads or refuses them.
WHOLE = {
    "ImageChunk": "refused: convert.prompt_tokens takes encoded_text chunks only, and names the chunk's type",
    "ImageAssetPointerChunk": "refused: convert.prompt_tokens takes encoded_text chunks only",
    "DmelChunk": "refused: convert.prompt_tokens takes encoded_text chunks only",
    "CustomLossInput": "tinkerd/custom_loss.py reads it (checked below: each field by name)",
    "CustomLossGraph": "tinkerd/custom_loss.py reads it (checked below)",
    "CustomLossNode": "tinkerd/custom_loss.py reads it (checked below)",
}

# Requests whose endpoint this server does not have: a call is a 404 or 405, not served otherwise.
NO_ENDPOINT: dict[str, tuple[str, str]] = {}

# Accepted, changing nothing the caller asked for.
INFORMATIONAL = {
    ("*", "type"): "the body's type tag: the route already says what the request is",
    ("CreateSessionRequest", "sdk_version"): "which SDK sent it; nothing here depends on it",
    ("ClientConfigRequest", "sdk_version"): "client/config answers every SDK the same (routes/service.py)",
    ("TelemetrySendRequest", "*"): "the SDK's telemetry (events of its own process): accepted and not kept, "
                                   "there is nothing to serve back",
    ("SampleRequest", "base_model"): "what to sample is the sampling session's (the SDK sends sampling_session_id); "
                                     "asample without one is a 404",
    ("SampleRequest", "model_path"): "as base_model",
}

# Accepted and not yet kept: known gaps, each waiting on a change outside the request models.
# Refusing them would break tinker-cookbook, which sends user_metadata on every run it creates.
PENDING = {
    ("CreateModelRequest", "user_metadata"): "a training run's user_metadata needs a column on models and "
                                             "the job that writes the run (gateway/jobs/training.py)",
    ("LoadWeightsRequest", "user_metadata"): "as CreateModelRequest's (the run create-via-load makes)",
    ("SaveWeightsForSamplerRequest", "user_metadata"): "a named sampler checkpoint's user_metadata needs the "
                                                       "job that records it (gateway/jobs/weights.py PushWeights)",
}

# A value that asks for each refused field (the SDK's JSON for it).
ASKING = {
    "base_model": "Qwen/Qwen3-8B", "weights_access_token": "tok-1",
    "age_encryption_recipients": ["age1qyqszqgpqyqszqgpqyqszqgpqyqszqgp"],
    "prompt_alt_tokens_k": 4,
}


def _sdk_requests() -> dict[str, type[pydantic.BaseModel]]:
    return {name: cls for name, cls in vars(sdk).items()
            if name.endswith("Request") and inspect.isclass(cls) and issubclass(cls, pydantic.BaseModel)}


def _wire_names(field_name: str, field) -> set[str]:
    names = {field_name}
    alias = field.validation_alias
    if isinstance(alias, pydantic.AliasChoices):
        names |= {c for c in alias.choices if isinstance(c, str)}
    elif isinstance(alias, str):
        names.add(alias)
    return names


def _ours(model: type[pydantic.BaseModel]) -> set[str]:
    return {n for name, f in model.model_fields.items() for n in _wire_names(name, f) | {f.alias or name}}


def _models_in(annotation) -> list[type[pydantic.BaseModel]]:
    """The pydantic models a field's annotation can hold (through Optional, Union, list, dict...)."""
    if inspect.isclass(annotation):
        return [annotation] if issubclass(annotation, pydantic.BaseModel) else []
    return [m for arg in typing.get_args(annotation) for m in _models_in(arg)]


def _listed(table: dict, model: str, field: str) -> str | None:
    return table.get((model, field)) or table.get(("*", field)) or table.get((model, "*"))


def _classify(sdk_model: type[pydantic.BaseModel], ours: type[pydantic.BaseModel] | None, where: str,
              problems: list[str], seen: set) -> None:
    if sdk_model in seen:
        return
    seen.add(sdk_model)
    name = sdk_model.__name__
    honoured = _ours(ours) if ours is not None else set()
    refused = getattr(ours, "refused", {})
    for field_name, field in sdk_model.model_fields.items():
        wire = _wire_names(field_name, field)
        if wire & honoured:
            for inner in _models_in(field.annotation):
                _walk_nested(inner, f"{where}.{field_name}", problems, seen)
        elif not (wire & set(refused) or _listed(INFORMATIONAL, name, field_name)
                  or _listed(PENDING, name, field_name)):
            problems.append(f"{where}.{field_name} ({name}) is neither served, refused nor listed")


def _walk_nested(sdk_model, where: str, problems: list[str], seen: set) -> None:
    name = sdk_model.__name__
    if name in WHOLE:
        return
    if name not in NESTED:
        problems.append(f"{where}: the SDK's {name} has no counterpart in NESTED or WHOLE")
        return
    _classify(sdk_model, NESTED[name], where, problems, seen)


def test_every_field_the_sdk_sends_is_served_refused_or_listed():
    assert tinker.__version__ == "0.38.0", "a new SDK: review its new fields and the lists above"
    requests = _sdk_requests()
    unknown = set(requests) - set(SERVED) - set(NO_ENDPOINT) - {m for m, _ in INFORMATIONAL if m != "*"}
    assert not unknown, f"requests this test does not place: {sorted(unknown)}"
    problems: list[str] = []
    for name, cls in requests.items():
        if name in SERVED:
            _classify(cls, SERVED[name], name, problems, set())
        elif name not in NO_ENDPOINT:
            for field_name in cls.model_fields:
                if not _listed(INFORMATIONAL, name, field_name):
                    problems.append(f"{name}.{field_name}: no body model reads it and it is not listed")
    assert not problems, "\n".join(problems)


def test_the_lists_hold_no_stale_entries():
    """A refused, informational or pending field is one the SDK has and our model does not serve."""
    requests = _sdk_requests()
    for model in {*SERVED.values(), *NESTED.values()}:
        sdk_names = [n for n, m in SERVED.items() if m is model] + [n for n, m in NESTED.items() if m is model]
        for field in getattr(model, "refused", {}):
            assert field not in model.model_fields, f"{model.__name__}.{field} is both a field and refused"
            assert any(field in requests.get(n, getattr(sdk, n, None)).model_fields for n in sdk_names), \
                f"{model.__name__} refuses {field}, which no SDK request of it has"
    for table in (INFORMATIONAL, PENDING):
        for model, field in table:
            if model == "*" or field == "*":
                continue
            assert field in requests[model].model_fields, (model, field)
            if model in SERVED:
                assert field not in _ours(SERVED[model]), f"{model}.{field} is served now: take it off the list"


def test_a_refused_field_is_a_400_naming_it_and_what_the_sdk_always_sends_is_not():
    """Through the models (the HTTP path: tests/e2e/test_wire_refusals.py): each refused field with a
    value that asks for it is refused by name; null, the SDK's default and empty values are not."""
    for model in {*SERVED.values()}:
        for field, served in getattr(model, "refused", {}).items():
            with pytest.raises(pydantic.ValidationError, match=rf"{field} is not served by this server"):
                model.model_validate({"model_id": "m", "path": "p", field: ASKING[field]})
            for quiet in (None, served.default, [], {}):
                model.model_validate({"model_id": "m", "path": "p", field: quiet})


def _sdk_bodies() -> dict[str, dict]:
    """Each served request as SDK 0.38 sends it with nothing optional asked for (exclude_none, as
    its resources/*.py do): the fields it always sends, at their defaults."""
    prompt = sdk.ModelInput.from_ints([1, 2, 3])
    made = {
        "CreateSessionRequest": sdk.CreateSessionRequest(tags=[], user_metadata=None, sdk_version="0.38.0"),
        "SessionHeartbeatRequest": sdk.SessionHeartbeatRequest(session_id="s"),
        "CreateModelRequest": sdk.CreateModelRequest(session_id="s", model_seq_id=0, base_model="b",
                                                     lora_config=sdk.LoraConfig(rank=4)),
        "GetInfoRequest": sdk.GetInfoRequest(model_id="m"),
        "UnloadModelRequest": sdk.UnloadModelRequest(model_id="m"),
        "OptimStepRequest": sdk.OptimStepRequest(model_id="m", seq_id=1, optim_params=sdk.AdamParams()),
        "SaveWeightsForSamplerRequest": sdk.SaveWeightsForSamplerRequest(model_id="m", seq_id=1,
                                                                         sampling_session_seq_id=0),
        "SaveWeightsRequest": sdk.SaveWeightsRequest(model_id="m", path="p", seq_id=1),
        "SaveWeightsExternalRequest": sdk.SaveWeightsExternalRequest(model_id="m", path="p", seq_id=1),
        "LoadWeightsRequest": sdk.LoadWeightsRequest(session_id="s", model_seq_id=1, path="tinker://r/weights/c",
                                                     optimizer=False),
        "CopyWeightsRequest": sdk.CopyWeightsRequest(source_path="tinker://r/weights/c", destination_project_id="p"),
        "CreateSamplingSessionRequest": sdk.CreateSamplingSessionRequest(session_id="s", sampling_session_seq_id=0,
                                                                         base_model="b"),
        "SampleRequest": sdk.SampleRequest(sampling_session_id="s:sample:0", seq_id=1, prompt=prompt,
                                           sampling_params=sdk.SamplingParams(max_tokens=4),
                                           prompt_logprobs=False, record_stability_info=False),
        "FutureRetrieveRequest": sdk.FutureRetrieveRequest(request_id="r", allow_metadata_only=True),
        "JoinSamplingSessionRequest": sdk.JoinSamplingSessionRequest(sampling_session_id="s:sample:0"),
        "FuturesRetrieveRequest": sdk.FuturesRetrieveRequest(
            target=sdk.SamplingSessionFuturesTarget(sampling_session_id="s:sample:0")),
        "SessionSearchRequest": sdk.SessionSearchRequest(),
        "GetBillingUsageRequest": sdk.GetBillingUsageRequest(
            starting_on=datetime.datetime(2026, 1, 1, tzinfo=datetime.timezone.utc),
            ending_before=datetime.datetime(2026, 1, 2, tzinfo=datetime.timezone.utc)),
        "GetCurrentCheckpointStorageUsageRequest": sdk.GetCurrentCheckpointStorageUsageRequest(),
    }
    return {name: request.model_dump(mode="json", exclude_none=True) for name, request in made.items()}


def test_what_the_sdk_always_sends_is_accepted():
    bodies = _sdk_bodies()
    assert set(bodies) == set(SERVED) - {"CreateCustomLossRequest"}    # its body is a traced graph
    for name, body in bodies.items():
        SERVED[name].model_validate(body)


def test_the_custom_loss_graph_is_read_field_by_field():
    """tinkerd/custom_loss.py reads the graph as plain JSON: every field of the SDK's graph models
    is a key it reads."""
    from tinker.types.custom_loss_graph import CustomLossGraph, CustomLossNode
    from tinker.types.custom_loss_input import CustomLossInput

    import tinkerd.custom_loss
    source = inspect.getsource(tinkerd.custom_loss)
    for model in (CustomLossInput, CustomLossGraph, CustomLossNode):
        for field in model.model_fields:
            assert re.search(rf"[\"']{field}[\"']", source), f"{model.__name__}.{field}: tinkerd/custom_loss.py reads no such key"


def test_requests_without_an_endpoint_here_have_none():
    served = {(method, route.path) for router in ROUTERS for route in router.routes
              for method in getattr(route, "methods", ())}
    for name, (method, path) in NO_ENDPOINT.items():
        assert (method, path) not in served, f"{name}: {method} {path} is served now: check its fields"
    assert CLIENT_CONFIG["sample_join_sampling_session"] is True      # served: routes/sampling.py


def _proto_fields(descriptor, seen=None):
    seen = set() if seen is None else seen
    if descriptor.full_name in seen:
        return
    seen.add(descriptor.full_name)
    for field in descriptor.fields:
        yield descriptor.name, field
        if field.message_type is not None:
            yield from _proto_fields(field.message_type, seen)


def test_every_field_of_the_sdks_protobuf_requests_is_parsed():
    """forward_backward's protobuf body: a field our copy of the message lacked would be skipped
    as unknown without a word. Each is parsed (same number and type); what convert.py then does
    with image and dmel chunks is refuse them."""
    ours = {d.name: d for d in tinker_wire_pb2.DESCRIPTOR.message_types_by_name.values()}
    ours |= {f"{d.name}.{n.name}": n for d in list(ours.values()) for n in d.nested_types}
    for message, field in _proto_fields(tinker_public_pb2.ForwardBackwardRequest.DESCRIPTOR):
        parent = field.containing_type
        key = parent.name if parent.containing_type is None else f"{parent.containing_type.name}.{parent.name}"
        mine = ours[key].fields_by_name.get(field.name)
        assert mine is not None, f"{key}.{field.name} is not in gateway/tinker_wire.proto"
        assert (mine.number, mine.type) == (field.number, field.type), f"{key}.{field.name}"
