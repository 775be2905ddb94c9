"""Thin Celery wrappers over the mirror's jobs (the control queue)."""

from celery import shared_task


@shared_task(name="serving.catalog.run_fetch_job")
def run_fetch_job(job_id: str) -> str:
    from serving.catalog import fetch
    from serving.catalog.models import FetchJob

    job = FetchJob.objects.filter(public_id=job_id).first()
    if job is None:
        return "gone"
    if job.kind == FetchJob.Kind.SERVE:
        from serving.catalog import serve

        return serve.run(job).status
    return fetch.run(job).status
