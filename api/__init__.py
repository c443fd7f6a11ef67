"""HTTP front end of horizon-ray (FastAPI); talks to the coordinator through one client object.

    from api.app import create_app          # create_app(client: CoordinatorClient, settings) -> FastAPI
    from api.settings import ApiSettings    # keys, data/model roots, uploads dir, jobs root, limits

Modules: ``app`` (factory, OpenAPI), ``auth`` (bearer keys -> the one tenant dependency), ``errors`` (the
one error mapping), ``limits`` (413), ``paths`` (confinement of spec paths), ``jobs`` / ``files`` /
``cluster_routes`` (routes), ``openai`` (the OpenAI-compatible /v1), ``outputs`` (a directory as a streamed
tar), ``schemas`` (pydantic models of the edge), ``metrics`` (Prometheus),
``server`` (uvicorn in a thread), ``testing`` (an in-process testbed), ``static/`` (the dashboard).
"""
