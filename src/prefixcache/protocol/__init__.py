"""The wire contract the server and the router share: errors, tenants, request schemas and
limits, the KV-event format. Needs no torch and imports no engine, server or router."""
