"""The Tinker REST API, one module per concern; gateway/app.py mounts every ROUTERS entry."""

from gateway.routes import (access_tokens, billing, checkpoints, custom_losses, download_links, files, futures,
                            identity, legacy, oai, projects, samplers, sampling, service, sessions, traces, training,
                            weights)

ROUTERS = [service.router, identity.router, sessions.router, training.router, weights.router, sampling.router,
           futures.router, checkpoints.router, download_links.router, files.router, samplers.router,
           legacy.router, oai.router, traces.router, custom_losses.router, projects.router,
           billing.router, access_tokens.router]
