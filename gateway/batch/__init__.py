"""The Batch API (OpenAI's ``/v1/files`` and ``/v1/batches``): a file of requests run by Celery workers
through the gateway at the batch priority, in the capacity interactive traffic leaves.

``files`` keeps the files and reads a batch input; ``service`` is what the API and the console do;
``runner`` runs a batch; ``lines`` is the gateway's side (a line sent at most once); ``sweep`` restarts
batches whose worker died and removes what is past retention.
"""
