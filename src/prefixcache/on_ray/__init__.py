"""``prefixcache ray``: the engine as a Ray Serve deployment, routed by our own router.

Ray places, restarts and scales the replicas; each replica supervises one ``prefixcache
serve`` process and our router (also supervised by a Ray Serve deployment) routes on their
caches. Nothing here is imported unless ``prefixcache ray`` runs (Ray is an extra).
"""
