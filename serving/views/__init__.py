"""Serving's console pages: deployments (``deployments``, with live state over SSE in ``live``) and the
model catalog and mirror (``catalog``), with their forms and tables."""
