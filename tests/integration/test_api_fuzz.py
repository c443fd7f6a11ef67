"""Property-based fuzz of the OpenAPI schema (schemathesis) against a real uvicorn: no request, valid or not,
gets a 500, and every answer to a valid request matches the documented status codes, content types and
schemas. A bounded number of examples per operation (HORIZON_FUZZ_EXAMPLES, default 25)."""

import os

import httpx
import hypothesis
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase
from hypothesis import strategies as st
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from api.app import create_app
from api.server import running_server
from api.testing import DATASET, make_testbed

pytestmark = [pytest.mark.integration, pytest.mark.slow]

EXAMPLES = int(os.environ.get("HORIZON_FUZZ_EXAMPLES", "25"))
CONFORMANCE = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]


def with_valid_paths(case, valid: bool):
    """Half the generated specs get model and data paths that exist, so the coordinator's own validation,
    planning and queueing are fuzzed too, not only the path checks in front of them."""
    if valid and isinstance(case.body, dict) and case.path in ("/finetune", "/plan", "/v1/fine_tuning/jobs"):
        case.body["model"] = {**(case.body.get("model") if isinstance(case.body.get("model"), dict) else {}),
                              "path": "1GiB"}
        case.body["model"].pop("tokenizer_path", None)
        case.body["data"] = {**(case.body.get("data") if isinstance(case.body.get("data"), dict) else {}),
                             "path": DATASET}
        case.body["data"].pop("eval_path", None)
        case.body.pop("output_dir", None)
    return case


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    bed = make_testbed(tmp_path_factory.mktemp("fuzz"), max_body_bytes=64 * 1024, max_upload_bytes=64 * 1024)
    try:
        with running_server(create_app(bed.client, bed.settings)) as url:
            yield bed, url
    finally:
        bed.close()


def operations(url):
    schema = schemathesis.openapi.from_url(f"{url}/openapi.json")
    return [result.ok() for result in schema.get_all_operations()]


def test_openapi_fuzz_never_answers_500(served):
    bed, url = served
    ops = operations(url)
    assert len(ops) >= 20
    headers = bed.auth("acme")
    failures: list[str] = []
    for op in ops:
        positive = st.tuples(op.as_strategy(generation_mode=GenerationMode.POSITIVE), st.booleans())
        negative = op.as_strategy(generation_mode=GenerationMode.NEGATIVE)

        @hypothesis.settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=True,
                             phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
        @hypothesis.given(pair=positive)
        def valid_requests(pair):
            case, valid = pair
            case = with_valid_paths(case, valid)
            case.call_and_validate(base_url=url, headers=headers, checks=CONFORMANCE, timeout=30)

        @hypothesis.settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=True,
                             phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
        @hypothesis.given(case=negative)
        def invalid_requests(case):
            case.call_and_validate(base_url=url, headers=headers, checks=[not_a_server_error], timeout=30)

        for run in (valid_requests, invalid_requests):
            try:
                run()
            except hypothesis.errors.Unsatisfiable:
                pass
            except Exception as exc:  # collect every operation's failure, then report them together
                failures.append(f"{op.method.upper()} {op.path} ({run.__name__}): {exc}")
    assert not failures, "\n\n".join(failures)

    # The fuzz reached past the edge: requests of every route were answered, and some specs became jobs.
    metrics = httpx.get(f"{url}/metrics", headers=headers).text  # /metrics takes a key (HORIZON_API_METRICS_OPEN)
    answered = sum(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
                   if line.startswith("horizon_api_requests_total{"))
    assert answered >= len(ops) * EXAMPLES
    jobs = httpx.get(f"{url}/finetune", params={"limit": 100}, headers=headers).json()["data"]
    print(f"fuzz: {int(answered)} requests over {len(ops)} operations; {len(jobs)} jobs created")
    assert jobs
