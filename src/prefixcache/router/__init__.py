"""Routing over replicas: a global index fed by KV events, policies, and the HTTP front.

The router never loads a model: it tokenizes as the replicas do, computes the same chained
block digests (rooted at the namespace digest they report), and learns what each replica
holds from its KV events.
"""
