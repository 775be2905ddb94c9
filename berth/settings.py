"""Berth's settings: every value comes from the environment through ``berth.env``.

With nothing set, Berth runs embedded: SQLite and a file-system Celery broker under the data
directory, a secret key generated once into it. ``DATABASE_URL`` and ``REDIS_URL`` switch to
PostgreSQL and Redis; outside the embedded mode ``BERTH_SECRET_KEY`` must be given.
"""

from __future__ import annotations

from pathlib import Path

import dj_database_url
from django.core.exceptions import ImproperlyConfigured

from berth import env

BASE_DIR = Path(__file__).resolve().parent.parent

DATA_DIR = env.path("BERTH_DATA_DIR", Path("var"), BASE_DIR)
DEBUG = env.boolean("BERTH_DEBUG", False)

DATABASE_URL = env.url("DATABASE_URL", ("postgres", "postgresql", "sqlite"))
REDIS_URL = env.url("REDIS_URL", ("redis", "rediss", "unix"))
EMBEDDED = DATABASE_URL is None

SECRET_KEY = env.string("BERTH_SECRET_KEY")
if SECRET_KEY is None:
    if not EMBEDDED:
        raise ImproperlyConfigured(
            "BERTH_SECRET_KEY (or BERTH_SECRET_KEY_FILE) is required when DATABASE_URL is set: "
            "every web process must share one key. Generate one with "
            "`python -c 'import secrets; print(secrets.token_urlsafe(50))'`."
        )
    SECRET_KEY = env.persistent_secret(DATA_DIR / "secret_key")
elif len(SECRET_KEY) < 32:
    raise ImproperlyConfigured("BERTH_SECRET_KEY is shorter than 32 characters: use a long random value.")

# The pepper of API keys' hashes: outside the database, so a copy of it cannot check or mint keys.
KEY_PEPPER = env.string("BERTH_KEY_PEPPER")
if KEY_PEPPER is None:
    if not EMBEDDED:
        raise ImproperlyConfigured(
            "BERTH_KEY_PEPPER (or BERTH_KEY_PEPPER_FILE) is required when DATABASE_URL is set: API keys are "
            "hashed with it, and every process must share it. Changing it invalidates every key."
        )
    KEY_PEPPER = env.persistent_secret(DATA_DIR / "key_pepper")
elif len(KEY_PEPPER) < 32:
    raise ImproperlyConfigured("BERTH_KEY_PEPPER is shorter than 32 characters: use a long random value.")

# Governance.
APPROVAL_TTL_HOURS = env.integer("BERTH_APPROVAL_TTL_HOURS", 72, minimum=1, maximum=24 * 90)
LOGIN_MAX_FAILURES = env.integer("BERTH_LOGIN_MAX_FAILURES", 5, minimum=1)
LOGIN_WINDOW_SECONDS = env.integer("BERTH_LOGIN_WINDOW_SECONDS", 900, minimum=10)
LOGIN_TRACKED_ENTRIES = env.integer("BERTH_LOGIN_TRACKED_ENTRIES", 10000, minimum=100)
PASSWORD_HASH_SLOTS = env.integer("BERTH_PASSWORD_HASH_SLOTS", 4, minimum=1, maximum=64)

ALLOWED_HOSTS = env.words("BERTH_ALLOWED_HOSTS", ["localhost", "127.0.0.1", "[::1]"])
CSRF_TRUSTED_ORIGINS = env.words("BERTH_CSRF_TRUSTED_ORIGINS", [])
HTTPS = env.boolean("BERTH_HTTPS", False)
SESSION_COOKIE_SECURE = CSRF_COOKIE_SECURE = HTTPS
SESSION_COOKIE_HTTPONLY = True
SECURE_CONTENT_TYPE_NOSNIFF = True
X_FRAME_OPTIONS = "DENY"

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "rest_framework",
    "drf_spectacular",
    "drf_spectacular_sidecar",
    "django_htmx",
    "django_filters",
    "django_celery_beat",
    "berth",
    "tenancy",
    "scheduler",
    "serving",
    "gateway",
]

MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "servestatic.middleware.ServeStaticMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
    "django_htmx.middleware.HtmxMiddleware",
]

ROOT_URLCONF = "berth.urls"
ASGI_APPLICATION = "berth.asgi.application"

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [BASE_DIR / "templates"],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
                "berth.context_processors.navigation",
                "berth.context_processors.memory_banner",
            ],
        },
    },
]

# SQLite waits for a writer rather than failing at once, and takes its write lock when a transaction
# begins (so two writers never deadlock upgrading read locks). Its test database is a file too, so the
# suite's own processes (a gateway, an agent) open the same one.
SQLITE_OPTIONS = {"timeout": 20, "transaction_mode": "IMMEDIATE"}
if EMBEDDED:
    DATABASES = {"default": {"ENGINE": "django.db.backends.sqlite3", "NAME": DATA_DIR / "berth.sqlite3",
                             "OPTIONS": SQLITE_OPTIONS, "TEST": {"NAME": DATA_DIR / "test-berth.sqlite3"}}}
else:
    try:
        DATABASES = {"default": dj_database_url.parse(DATABASE_URL, conn_max_age=60, conn_health_checks=True)}
    except ValueError as exc:
        raise ImproperlyConfigured(f"DATABASE_URL cannot be parsed: {exc}") from exc
    if DATABASES["default"]["ENGINE"] == "django.db.backends.sqlite3":
        DATABASES["default"].update(CONN_MAX_AGE=0, OPTIONS=SQLITE_OPTIONS)
    elif DATABASES["default"]["ENGINE"] == "django.db.backends.postgresql":
        # A database that does not answer is an error within seconds, not a request held until the
        # kernel gives up on the connection (what rides it out — the gateway's keys and routing, the
        # supervisor — needs the error to act on).
        DATABASES["default"].setdefault("OPTIONS", {}).setdefault("connect_timeout", 5)
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

if REDIS_URL:
    # A stalled Redis is an error within a second, so a console page says what it cannot show
    # rather than hang (the cache holds no record: losing it costs a banner or a placement hint).
    CACHES = {"default": {"BACKEND": "django.core.cache.backends.redis.RedisCache", "LOCATION": REDIS_URL,
                          "OPTIONS": {"socket_timeout": 1, "socket_connect_timeout": 1}}}
else:
    CACHES = {"default": {"BACKEND": "django.core.cache.backends.filebased.FileBasedCache",
                          "LOCATION": DATA_DIR / "cache"}}

# Argon2 first: new and changed passwords are hashed with it; older hashes upgrade on login.
PASSWORD_HASHERS = [
    "django.contrib.auth.hashers.Argon2PasswordHasher",
    "django.contrib.auth.hashers.PBKDF2PasswordHasher",
]
AUTH_PASSWORD_VALIDATORS = [
    {"NAME": "django.contrib.auth.password_validation.UserAttributeSimilarityValidator"},
    {"NAME": "django.contrib.auth.password_validation.MinimumLengthValidator", "OPTIONS": {"min_length": 12}},
    {"NAME": "django.contrib.auth.password_validation.CommonPasswordValidator"},
    {"NAME": "django.contrib.auth.password_validation.NumericPasswordValidator"},
]
AUTHENTICATION_BACKENDS = ["tenancy.backends.BoundedHashingBackend"]
LOGIN_URL = "login"
LOGIN_REDIRECT_URL = "dashboard"
LOGOUT_REDIRECT_URL = "login"

LANGUAGE_CODE = "en-gb"
TIME_ZONE = "UTC"
USE_I18N = False
USE_TZ = True

STATIC_URL = "static/"
STATICFILES_DIRS = [BASE_DIR / "static"]
STATIC_ROOT = DATA_DIR / "static"
# ServeStatic (WhiteNoise with native ASGI support) serves static files from the app and project folders directly: no collectstatic step.
SERVESTATIC_USE_FINDERS = True
SERVESTATIC_AUTOREFRESH = DEBUG

REST_FRAMEWORK = {
    "DEFAULT_AUTHENTICATION_CLASSES": ["tenancy.api.authentication.CredentialAuthentication",
                                       "rest_framework.authentication.SessionAuthentication"],
    "DEFAULT_PERMISSION_CLASSES": ["rest_framework.permissions.IsAuthenticated"],
    "DEFAULT_SCHEMA_CLASS": "drf_spectacular.openapi.AutoSchema",
    "EXCEPTION_HANDLER": "berth.api.exception_handler",
    "DEFAULT_PAGINATION_CLASS": "berth.api.Pagination",
    "PAGE_SIZE": 100,
    "UNAUTHENTICATED_USER": "django.contrib.auth.models.AnonymousUser",
}
SPECTACULAR_SETTINGS = {
    "TITLE": "Berth management API",
    "DESCRIPTION": "Organisations, capacity, fleet, models and deployments. "
                   "Inference is served separately under /v1/ (OpenAI-compatible).",
    "VERSION": "0.1.0",
    "SERVE_INCLUDE_SCHEMA": False,
    "SWAGGER_UI_DIST": "SIDECAR",
    "SWAGGER_UI_FAVICON_HREF": "SIDECAR",
    "REDOC_DIST": "SIDECAR",
}

# Celery: Redis when REDIS_URL is set, else kombu's file-system transport under the data
# directory, which needs no server (the embedded mode). Results are kept in our own rows.
BROKER_DIR = DATA_DIR / "broker"
if REDIS_URL:
    CELERY_BROKER_URL = REDIS_URL
    CELERY_BROKER_TRANSPORT_OPTIONS = {"visibility_timeout": 3600}
else:
    CELERY_BROKER_URL = "filesystem://"
    CELERY_BROKER_TRANSPORT_OPTIONS = {
        "data_folder_in": str(BROKER_DIR / "queue"),
        "data_folder_out": str(BROKER_DIR / "queue"),
        "processed_folder": str(BROKER_DIR / "processed"),
        "control_folder": str(BROKER_DIR / "control"),
        "polling_interval": 0.1,  # the agent notices a start within 100 ms, not the default second
        "store_processed": False,
    }
CELERY_TASK_IGNORE_RESULT = True
CELERY_TASK_DEFAULT_QUEUE = "control"
# Batches run for hours: on a queue of their own, so they never hold the control worker's slots.
BATCH_QUEUE = "batch"
CELERY_TASK_ROUTES = {"gateway.run_batch": {"queue": BATCH_QUEUE}}
CELERY_TASK_ACKS_LATE = True
CELERY_WORKER_PREFETCH_MULTIPLIER = 1
CELERY_BROKER_CONNECTION_RETRY_ON_STARTUP = True
CELERY_BEAT_SCHEDULER = "django_celery_beat.schedulers:DatabaseScheduler"
# Periodic work, one named table (beat copies it into the database at start; the admin can pause entries).
CELERY_BEAT_SCHEDULE = {
    "scheduler: mark nodes without heartbeats lost": {"task": "scheduler.mark_lost_nodes", "schedule": 30.0},
    "serving: lost nodes, idle on-demand models, the placement plan": {"task": "serving.reconcile",
                                                                         "schedule": 15.0},
    "gateway: write usage parked while the database refused it": {"task": "gateway.retry_usage", "schedule": 60.0},
    "gateway: batches without a live worker, expired windows, files past retention": {
        "task": "gateway.sweep_batches", "schedule": 10.0},
    "serving: return expired node job leases": {"task": "serving.expire_node_leases", "schedule": 10.0},
}
# Backups (berth/backup.py): where `manage.py backup` writes its archives and how many of the newest it
# keeps; with a directory set, beat takes one a day.
BACKUP_DIR = env.path("BERTH_BACKUP_DIR", None, BASE_DIR) if env.string("BERTH_BACKUP_DIR") else None
BACKUP_KEEP = env.integer("BERTH_BACKUP_KEEP", 7, minimum=1, maximum=1000)
if BACKUP_DIR is not None:
    CELERY_BEAT_SCHEDULE["berth: back up the database and secrets"] = {"task": "berth.backup",
                                                                       "schedule": 24 * 3600.0}
CELERY_TIMEZONE = TIME_ZONE

# Where engines are built and cached: outside the work tree, shared by every checkout.
ENGINE_CACHE_DIR = env.path("BERTH_ENGINE_CACHE", Path.home() / ".cache" / "berth" / "engines", BASE_DIR)
NODE_NAME = env.string("BERTH_NODE_NAME")  # defaults to the host name
NODE_ADDRESS = env.string("BERTH_NODE_ADDRESS", "127.0.0.1")
# The node's own credential (manage.py agent keeps it there, mode 0600) and the CA certificates an
# https control plane is verified with (empty: the system's).
NODE_CREDENTIAL_FILE = env.path("BERTH_NODE_CREDENTIAL_FILE", DATA_DIR / "node" / "credential", BASE_DIR)
NODE_CA_FILE = env.string("BERTH_NODE_CA_FILE")

LOG_LEVEL = env.string("BERTH_LOG_LEVEL", "INFO").upper()
if LOG_LEVEL not in {"DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"}:
    raise ImproperlyConfigured(f"BERTH_LOG_LEVEL={LOG_LEVEL!r} is not one of DEBUG, INFO, WARNING, ERROR, CRITICAL.")
LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {"plain": {"format": "%(asctime)s %(levelname)s %(name)s %(message)s"}},
    "handlers": {"console": {"class": "logging.StreamHandler", "formatter": "plain"}},
    "root": {"handlers": ["console"], "level": LOG_LEVEL},
    "loggers": {"django.db.backends": {"level": "WARNING"},
                # One line per engine poll would drown the agent's log; kombu's file transport warns
                # that it has no host name, which it never needs.
                "httpx": {"level": "WARNING"}, "kombu.connection": {"level": "ERROR"}},
}

# Scheduler
SCHEDULER_NODE_LOST_AFTER = env.integer("BERTH_NODE_LOST_AFTER", 120, minimum=10)  # seconds without heartbeat
SCHEDULER_TELEMETRY_SAMPLES = env.integer("BERTH_TELEMETRY_SAMPLES", 60, minimum=1, maximum=10_000)  # kept per node/GPU
# Fit: memory kept free for the system, on unified-memory machines (and CPU nodes) in GiB, on discrete GPUs in %.
SCHEDULER_SAFETY_MARGIN_UNIFIED_GIB = env.integer("BERTH_SAFETY_MARGIN_UNIFIED_GIB", 8, minimum=0)
SCHEDULER_SAFETY_MARGIN_GPU_PERCENT = env.integer("BERTH_SAFETY_MARGIN_GPU_PERCENT", 5, minimum=0, maximum=50)
# Calibration: margin added to a measured load when it replaces the estimate, and how far an
# out-of-memory failure with evidence raises the next estimate (both in %).
SCHEDULER_CALIBRATION_MARGIN_PERCENT = env.integer("BERTH_CALIBRATION_MARGIN_PERCENT", 5, minimum=0, maximum=100)
SCHEDULER_OOM_RAISE_PERCENT = env.integer("BERTH_OOM_RAISE_PERCENT", 25, minimum=1, maximum=400)
# Directories the estimate form and API may read model files from (comma-separated).
SCHEDULER_MODEL_ROOTS = [Path(p).expanduser().resolve() for p in env.words("BERTH_MODEL_ROOTS", [str(DATA_DIR / "models")])]

# Serving: deployments.
SERVING_STARTUP_SLOTS = env.integer("BERTH_STARTUP_SLOTS", 1, minimum=1, maximum=64)
SERVING_QUEUE_TIMEOUT_SECONDS = env.integer("BERTH_QUEUE_TIMEOUT_SECONDS", 1800, minimum=1)
SERVING_STARTUP_TIMEOUT_SECONDS = env.integer("BERTH_STARTUP_TIMEOUT_SECONDS", 900, minimum=5)
# A wake takes a start-up slot like a start: the request waits this long for it to be awake, then
# answers 202 with its place in line while the wake goes on, for at most the timeout in all.
SERVING_WAKE_WAIT_SECONDS = env.integer("BERTH_WAKE_WAIT_SECONDS", 50, minimum=0, maximum=600)
SERVING_WAKE_TIMEOUT_SECONDS = env.integer("BERTH_WAKE_TIMEOUT_SECONDS", 300, minimum=5, maximum=86400)
# Where a node agent reaches the control plane's web server to fetch the mirror's weights it lacks
# (serving.node.weights); `serve` sets it for the agent it runs. A fetch link lasts this long.
SERVING_CONTROL_URL = env.string("BERTH_CONTROL_URL", "http://127.0.0.1:8000").rstrip("/")
SERVING_WEIGHTS_LINK_SECONDS = env.integer("BERTH_WEIGHTS_LINK_SECONDS", 3600, minimum=60, maximum=7 * 86400)
# A stopping replica's requests in flight (as the gateways report them) may finish for this long.
SERVING_DRAIN_SECONDS = env.integer("BERTH_DRAIN_SECONDS", 30, minimum=0, maximum=3600)
SERVING_HEARTBEAT_SECONDS = env.integer("BERTH_HEARTBEAT_SECONDS", 5, minimum=1, maximum=300)
# A node holds a job it claimed this long unless it extends the lease (serving.control.node_jobs);
# a lease that runs out returns the job to the queue.
SERVING_NODE_LEASE_SECONDS = env.integer("BERTH_NODE_LEASE_SECONDS", 30, minimum=1, maximum=3600)
# At critical memory the watchdog warns (a logged, audited level change and the console's banner,
# and a warning naming what it would stop); with this on it also stops the least important deployment
# rather than let the kernel's OOM killer choose. Off by default: stopping a model is an operator's call.
SERVING_AUTO_PROTECT = env.boolean("BERTH_AUTO_PROTECT", False)
_ports = env.string("BERTH_ENGINE_PORTS", "20000-29999")
try:
    SERVING_PORT_RANGE = tuple(int(p) for p in _ports.split("-", 1))
    if len(SERVING_PORT_RANGE) != 2 or not 1024 <= SERVING_PORT_RANGE[0] <= SERVING_PORT_RANGE[1] <= 65535:
        raise ValueError
except ValueError:
    raise ImproperlyConfigured(f"BERTH_ENGINE_PORTS={_ports!r} is not a port range like 20000-29999 (1024-65535).") from None

# Gateway
# How long an authenticated key is trusted in-process before the database is asked again (seconds);
# a revocation reaches every process at once over Redis, expiry and disabling within this window.
GATEWAY_AUTH_CACHE_SECONDS = env.integer("BERTH_GATEWAY_AUTH_CACHE_SECONDS", 5, minimum=0, maximum=300)
# While the database cannot be reached, a key read before keeps being trusted this much longer after its
# reading expired (seconds; 0: not at all). Revocations heard over Redis meanwhile still apply at once;
# a key not read within the window gets 503 `database_unavailable` with Retry-After.
GATEWAY_AUTH_STALE_SECONDS = env.integer("BERTH_GATEWAY_AUTH_STALE_SECONDS", 300, minimum=0, maximum=86_400)
# How long the limiter waits for Redis (connect, and each reply) before refusing with 503
# `limiter_unavailable`: a stalled Redis costs a limited request this much, not a hang.
GATEWAY_REDIS_TIMEOUT = env.integer("BERTH_GATEWAY_REDIS_TIMEOUT_MS", 250, minimum=10, maximum=60_000) / 1000
GATEWAY_ROUTING_TTL = env.integer("BERTH_GATEWAY_ROUTING_TTL_MS", 1500, minimum=50, maximum=60_000) / 1000
GATEWAY_MAX_BODY_BYTES = env.integer("BERTH_GATEWAY_MAX_BODY_BYTES", 8 * 1024 * 1024, minimum=1024)
# Admission while a model loads: waiting requests per model and process, and how long each waits.
GATEWAY_ADMISSION_QUEUE = env.integer("BERTH_GATEWAY_ADMISSION_QUEUE", 64, minimum=0, maximum=100_000)
GATEWAY_ADMISSION_TIMEOUT = env.integer("BERTH_GATEWAY_ADMISSION_TIMEOUT", 30, minimum=1, maximum=3600)
GATEWAY_EXPECTED_LOAD_SECONDS = env.integer("BERTH_GATEWAY_EXPECTED_LOAD_SECONDS", 60, minimum=1)
# A request whose model's replicas have every slot busy waits in the gateway, in priority order
# (gateway.slots): at most this many per model and process, each at most this many seconds.
GATEWAY_SLOT_QUEUE = env.integer("BERTH_GATEWAY_SLOT_QUEUE", 512, minimum=1, maximum=1_000_000)
GATEWAY_SLOT_WAIT = env.integer("BERTH_GATEWAY_SLOT_WAIT_SECONDS", 120, minimum=1, maximum=3600)
# Upstream timeouts (seconds): to the first byte of the engine's answer, and for the whole request.
GATEWAY_FIRST_BYTE_TIMEOUT = env.integer("BERTH_GATEWAY_FIRST_BYTE_TIMEOUT", 120, minimum=1)
GATEWAY_TOTAL_TIMEOUT = env.integer("BERTH_GATEWAY_TOTAL_TIMEOUT", 900, minimum=1)
# A replica whose connections fail this many times in a row leaves routing for the cool-down.
GATEWAY_BREAKER_FAILURES = env.integer("BERTH_GATEWAY_BREAKER_FAILURES", 3, minimum=1)
GATEWAY_BREAKER_SECONDS = env.integer("BERTH_GATEWAY_BREAKER_SECONDS", 30, minimum=1)
# A request to a scope under a hard token budget that names no output limit, on a model without a
# catalog cap, may produce this many tokens at most: what its admission reserves (and it is sent).
GATEWAY_BUDGET_OUTPUT_TOKENS = env.integer("BERTH_GATEWAY_BUDGET_OUTPUT_TOKENS", 4096, minimum=1, maximum=1 << 20)
# Usage records are written in batches: every this many milliseconds, or at this many records.
GATEWAY_USAGE_FLUSH_MS = env.integer("BERTH_GATEWAY_USAGE_FLUSH_MS", 1000, minimum=10)
GATEWAY_USAGE_BATCH = env.integer("BERTH_GATEWAY_USAGE_BATCH", 500, minimum=1)
GATEWAY_ACCESS_LOG = env.boolean("BERTH_GATEWAY_ACCESS_LOG", True)
# /metrics answers this machine only, or anyone who sends this token as a bearer (a secret: never logged).
GATEWAY_METRICS_TOKEN = env.string("BERTH_METRICS_TOKEN", "")
# Where the console's playground sends its requests (this server's own /v1/ when unset).
GATEWAY_INTERNAL_URL = env.string("BERTH_GATEWAY_INTERNAL_URL", "")
# Where the control worker reaches the gateway (serve_model's smoke request): the same address when
# set, else the web server that `manage.py serve` (and `make up`) runs on this machine.
SERVING_GATEWAY_URL = GATEWAY_INTERNAL_URL or "http://127.0.0.1:8000"
# The Batch API (gateway.batch): files under the data directory, run by the control worker through the
# gateway above (SERVING_GATEWAY_URL) at the batch priority, this many of a batch's requests at a time.
BATCH_DIR = DATA_DIR / "batches"
BATCH_MAX_FILE_BYTES = env.integer("BERTH_BATCH_MAX_FILE_BYTES", 200 * 1024 * 1024, minimum=1024)
BATCH_MAX_LINES = env.integer("BERTH_BATCH_MAX_LINES", 50_000, minimum=1, maximum=1_000_000)
BATCH_CONCURRENCY = env.integer("BERTH_BATCH_CONCURRENCY", 8, minimum=1, maximum=256)
# A worker renews its hold on a batch while it runs it; one that died is taken over when this lapses.
BATCH_LEASE_SECONDS = env.integer("BERTH_BATCH_LEASE_SECONDS", 30, minimum=2, maximum=3600)
# Files (inputs, outputs, errors) and ended batches with their answers are deleted this long after.
BATCH_RETENTION_DAYS = env.integer("BERTH_BATCH_RETENTION_DAYS", 30, minimum=1, maximum=3650)

# Serving: engines and runtimes
# Model files a deployment may name are SCHEDULER_MODEL_ROOTS (BERTH_MODEL_ROOTS), the estimate's too.
# Pidfiles, exit files and logs of engines run as processes on this node.
SERVING_ENGINE_DIR = env.path("BERTH_ENGINE_DIR", DATA_DIR / "engines", BASE_DIR)
# Images are used only when already on the node unless pulling is allowed (most nodes reach no registry).
SERVING_DOCKER_ALLOW_PULL = env.boolean("BERTH_DOCKER_ALLOW_PULL", False)
SERVING_VLLM_IMAGE_TAG = env.string("BERTH_VLLM_IMAGE_TAG", "v0.11.0")
# The access log: bare JSON lines (one per request) on standard output, written in batches.
LOGGING["formatters"]["bare"] = {"format": "%(message)s"}
LOGGING["handlers"]["access"] = {"class": "logging.StreamHandler", "formatter": "bare", "stream": "ext://sys.stdout"}
LOGGING["loggers"]["berth.gateway.access"] = {"handlers": ["access"], "level": "INFO", "propagate": False}
# Two scheduler fields are named "kind" (an engine's, an accelerator's): name their enums in the schema.
SPECTACULAR_SETTINGS.setdefault("ENUM_NAME_OVERRIDES", {}).update({
    "AcceleratorKindEnum": "scheduler.models.Accelerator.Kind",
    "EngineKindEnum": "scheduler.models.NodeEngine.Kind",
    "EngineNameEnum": "scheduler.memory.ENGINES",  # the same names without labels (estimates)
    "DeploymentStateEnum": "serving.models.DeploymentState",
})

# Serving: catalog and mirror
# The hub the mirror fetches from (HF_ENDPOINT, as huggingface_hub reads it) and an optional token (HF_TOKEN).
SERVING_HUB_ENDPOINT = env.string("HF_ENDPOINT", "https://huggingface.co")
SERVING_HUB_TOKEN = env.string("HF_TOKEN", "")
SERVING_HUB_TIMEOUT = env.integer("BERTH_HUB_TIMEOUT_SECONDS", 10, minimum=1, maximum=600)
# Weights shipped only as pickle files can run code when loaded: refused unless this is on and an administrator asks.
SERVING_MIRROR_ALLOW_PICKLE = env.boolean("BERTH_MIRROR_ALLOW_PICKLE", False)
# Space a fetch leaves free on the mirror's disk.
SERVING_MIRROR_DISK_MARGIN_BYTES = env.integer("BERTH_MIRROR_DISK_MARGIN_BYTES", 1 << 30, minimum=0)

# Scheduler: the placement policy
# How many placement decisions (applied plans, explain and headroom dry runs) are kept as evidence.
SCHEDULER_DECISION_HISTORY = env.integer("BERTH_SCHEDULER_DECISION_HISTORY", 10_000, minimum=100)
# The policy's rules an operator may tune (scheduler.conf.policy_settings): how long a new replica
# is safe from preemption, how long a preempted model is held back, how many replicas one preemption
# may stop, after how many failed launches in a row a model is parked, and how long a waiting load
# defers to idle replicas worth more before it may push them out. `manage.py bench_policy --only
# trace` shows what the minimum lifetime trades: fewer refusals for more cold starts.
SCHEDULER_MIN_LIFETIME_SECONDS = env.integer("BERTH_SCHEDULER_MIN_LIFETIME_SECONDS", 300, minimum=0, maximum=86_400)
SCHEDULER_PREEMPT_HOLD_SECONDS = env.integer("BERTH_SCHEDULER_PREEMPT_HOLD_SECONDS", 300, minimum=0, maximum=86_400)
SCHEDULER_MAX_VICTIMS = env.integer("BERTH_SCHEDULER_MAX_VICTIMS", 3, minimum=1, maximum=16)
SCHEDULER_PARK_AFTER = env.integer("BERTH_SCHEDULER_PARK_AFTER", 5, minimum=1, maximum=50)
SCHEDULER_STARVED_AFTER_SECONDS = env.integer("BERTH_SCHEDULER_STARVED_AFTER_SECONDS", 30, minimum=0, maximum=3600)
# A replica that can sleep (vLLM) is put to sleep rather than stopped when room is made or it goes
# idle, if its model was asked for within this long; asleep this long unasked, it is stopped.
SCHEDULER_SLEEP_WINDOW_SECONDS = env.integer("BERTH_SCHEDULER_SLEEP_WINDOW_SECONDS", 3600, minimum=0,
                                             maximum=7 * 86_400)
