"""Tenants and their API keys (stored hashed); the authentication dependency."""
