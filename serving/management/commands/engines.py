import os
from pathlib import Path

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError

from berth.errors import BerthError
from serving.engines import build_llamacpp, llamacpp_image
from serving.engines.installed import local_engines
from serving.node import registration as services


class Command(BaseCommand):
    help = "Build and list the inference engines of this machine."

    def add_arguments(self, parser):
        sub = parser.add_subparsers(dest="action", required=True)
        build = sub.add_parser("build", help="Build an engine (or reuse the cached build).")
        build.add_argument("kind", choices=services.BUILDABLE_ENGINES)
        build.add_argument("--force", action="store_true", help="Rebuild even when a cached build runs.")
        build.add_argument("--jobs", type=int, default=None, help="Parallel compile jobs (default: CPU count).")
        sub.add_parser("list", help="List the engines installed on this machine.")
        image = sub.add_parser("image", help="Build the engine's local Docker image when it is missing.")
        image.add_argument("kind", choices=("llamacpp",))
        image.add_argument("--force", action="store_true", help="Rebuild the image (and its base) even when present.")

    def handle(self, *args, action, **options):
        if action == "list":
            engines = local_engines()
            if not engines:
                self.stdout.write("No engines installed. Build one with `manage.py engines build llamacpp`.")
            for engine in engines:
                self.stdout.write(f"{engine.kind}\t{engine.version}\t{engine.state}\t{engine.path}")
            return
        if action == "image":
            self._image(force=options["force"])
            return
        try:
            engine = services.build_engine(options["kind"], force=options["force"], jobs=options["jobs"],
                                           progress=lambda step, message: self.stdout.write(f"[{step}] {message}"))
        except BerthError as exc:
            raise CommandError(exc.message) from exc
        verb = "reused" if engine.reused else "built"
        self.stdout.write(self.style.SUCCESS(f"{engine.kind} {engine.version} {verb}: {engine.path}"))

    def _image(self, force: bool) -> None:
        import docker
        import docker.errors

        say = lambda step, message: self.stdout.write(f"[{step}] {message}")  # noqa: E731
        try:
            client = docker.from_env()
            client.ping()
        except docker.errors.DockerException as exc:
            raise CommandError(f"No Docker daemon answers (DOCKER_HOST={os.environ.get('DOCKER_HOST', 'unset')}): {exc}")
        try:
            image = llamacpp_image.build_image(client, Path(settings.ENGINE_CACHE_DIR), progress=say, force=force)
        except (llamacpp_image.ImageBuildError, build_llamacpp.BuildError) as exc:
            raise CommandError(str(exc)) from exc
        finally:
            client.close()
        self.stdout.write(self.style.SUCCESS(f"llamacpp image: {image}"))
