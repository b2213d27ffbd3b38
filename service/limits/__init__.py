"""Per-tenant limits shared by every API process (they live in the database): a token bucket of
requests, caps on unfinished jobs and open event streams, a quota of stored bytes."""
