"""The web console, served by the gateway under /console: plain HTML and a small script
(gateway/console/static/, no build step, nothing fetched from elsewhere) that logs in with an API
key and calls the API with it, so a user sees exactly what the API shows them.

The pages read the Tinker REST routes where they exist (training runs, checkpoints and their
publish/unpublish/delete, sessions, create_sampling_session, asample, retrieve_future); the few
things they have no route for are the small JSON routes here under /api/v1/console/, with the
same ownership rule (another user's run is a 404 like a missing one).
"""

from gateway.console.routes import api_router, page_router

__all__ = ["api_router", "page_router"]
