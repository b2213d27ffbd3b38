"""Kiln's compilation service: FastAPI app, database, storage, client and CLI.

A package per domain (tenants, models, jobs, devices, profiles), each with its database tables,
API schemas, service functions and router. Nothing in `kiln/` imports this package.
"""
