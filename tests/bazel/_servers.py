"""The servers the Bazel tests start on loopback: nginx with WebDAV (Bazel's HTTP cache),
BuildGrid (REAPI over gRPC), PostgreSQL and buildbox workers. They are tools/local_services.py's,
the ones tools/cache_local.sh and tools/rbe_local.sh start, from the same configurations.
"""

from __future__ import annotations

from helpers.net import local_services

ServerError = local_services.ServerError
NginxCache = local_services.NginxCache
BuildGridCache = local_services.BuildGridCache
PostgreSQL = local_services.PostgreSQL
BuildGridExecution = local_services.BuildGridExecution
BuildboxWorker = local_services.BuildboxWorker
find_postgres = local_services.find_postgres
in_worker_root = local_services.in_worker_root
WORKER_DIR = local_services.WORKER_DIR
START_TIMEOUT_S = local_services.START_TIMEOUT_S

__all__ = ["START_TIMEOUT_S", "WORKER_DIR", "BuildGridCache", "BuildGridExecution", "BuildboxWorker",
           "NginxCache", "PostgreSQL", "ServerError", "find_postgres", "in_worker_root"]
