"""Benchmark: API-key authentication and the limit-chain read at scale.

Builds 1,000 scopes and 100,000 keys inside one transaction that is rolled back at the end (the
database is left as it was), then times the services the gateway and scheduler call on every
request. Baselines measured in the same run: a bare indexed lookup through a raw cursor (the floor
any key check pays), and a password-style Argon2 check (what hashing keys like passwords would cost).
"""

from __future__ import annotations

import random
import statistics
import time
from decimal import Decimal

from django.contrib.auth.hashers import check_password, make_password
from django.core.management.base import BaseCommand, CommandError
from django.db import connection, transaction

from tenancy import keys
from tenancy.models import Contract, Credential, Scope, ServiceClient
from tenancy.services import clients, contracts


class Rollback(Exception):
    pass


def timed(function, samples) -> list[float]:
    durations = []
    for sample in samples:
        started = time.perf_counter()
        function(sample)
        durations.append((time.perf_counter() - started) * 1000)
    return durations


class Command(BaseCommand):
    help = "Time key authentication and the limit-chain read against this database (data rolled back)."

    def add_arguments(self, parser):
        parser.add_argument("--keys", type=int, default=100_000)
        parser.add_argument("--samples", type=int, default=2_000)
        parser.add_argument("--seed", type=int, default=7)

    def handle(self, *args, keys: int, samples: int, seed: int, **options):
        if connection.vendor != "postgresql":
            raise CommandError("Run the benchmark against PostgreSQL (set DATABASE_URL).")
        if keys < 1000 or samples < 100:
            raise CommandError("--keys must be at least 1000 and --samples at least 100.")
        rng = random.Random(seed)
        try:
            with transaction.atomic():
                rows = self._measure(keys, samples, rng)
                raise Rollback
        except Rollback:
            pass
        self._print(rows, keys)

    def _build(self, key_count: int, rng):
        started = time.perf_counter()
        scopes = []
        for o in range(10):  # 10 orgs x 9 teams x 10 projects + 10 + 90 = 1,000 scopes
            org = Scope.objects.create(kind="org", slug=f"org{o}", name=f"Org {o}", path=f"org{o}")
            scopes.append(org)
            for t in range(9):
                team = Scope.objects.create(kind="team", slug=f"team{t}", name=f"Team {t}", parent=org,
                                            path=f"{org.path}/team{t}")
                scopes.append(team)
                projects = Scope.objects.bulk_create(
                    [Scope(kind="project", slug=f"p{p}", name=f"P{p}", parent=team, path=f"{team.path}/p{p}")
                     for p in range(10)])
                scopes.extend(projects)
        projects = [s for s in scopes if s.kind == "project"]
        Contract.objects.bulk_create([Contract(scope=s, gpu_memory_gib_limit=Decimal(80 * (1 + s.path.count("/"))))
                                      for s in scopes if s.kind != "project" or rng.random() < 0.5])
        client_rows = ServiceClient.objects.bulk_create(
            [ServiceClient(project=p, name=f"client{i}", all_models=True) for p in projects for i in range(2)])
        plaintexts, credentials = [], []
        for index in range(key_count):
            plaintext, lookup, secret = keys.new_key()
            plaintexts.append(plaintext)
            credentials.append(Credential(client=client_rows[index % len(client_rows)], lookup=lookup,
                                          secret_hash=keys.digest(secret)))
        Credential.objects.bulk_create(credentials, batch_size=5000)
        with connection.cursor() as cursor:
            cursor.execute("ANALYZE tenancy_credential; ANALYZE tenancy_scope; ANALYZE tenancy_contract")
        return len(scopes), projects, plaintexts, time.perf_counter() - started

    def _measure(self, key_count: int, sample_count: int, rng):
        scope_count, projects, plaintexts, build_seconds = self._build(key_count, rng)
        self.stdout.write(f"built {scope_count} scopes and {key_count} keys in {build_seconds:.1f}s")
        sample_keys = rng.sample(plaintexts, sample_count)
        sample_scopes = [rng.choice(projects) for _ in range(sample_count)]
        lookups = [keys.parse(k)[0] for k in sample_keys]

        def raw_lookup(lookup):
            with connection.cursor() as cursor:
                cursor.execute("SELECT id, secret_hash FROM tenancy_credential WHERE lookup = %s", [lookup])
                cursor.fetchone()

        first_use = timed(clients.authenticate, sample_keys)  # writes last_used_at once per key
        steady = timed(clients.authenticate, sample_keys)
        floor = timed(raw_lookup, lookups)
        chain = timed(contracts.limit_chain, sample_scopes)
        check = timed(lambda s: contracts.check_addition(s, gpu_memory_gib=8), sample_scopes)
        encoded = make_password("x" * 43)
        argon = timed(lambda _: check_password("x" * 43, encoded), range(20))
        return [
            ("authenticate (steady: lookup + HMAC compare)", steady, floor),
            ("authenticate (first use: + last_used_at write)", first_use, floor),
            ("limit chain of a project", chain, floor),
            ("check_addition (chain + holdings)", check, floor),
            ("baseline: raw indexed lookup", floor, floor),
            ("baseline: Argon2 password-style check", argon, floor),
        ]

    def _print(self, rows, key_count):
        def p99(values):
            ordered = sorted(values)
            return ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))]

        floor_median = statistics.median(rows[4][1])
        self.stdout.write(f"\n{'operation':<50} {'n':>6} {'median ms':>10} {'p99 ms':>9} {'x raw lookup':>13}")
        for name, values, _ in rows:
            median = statistics.median(values)
            self.stdout.write(f"{name:<50} {len(values):>6} {median:>10.3f} {p99(values):>9.3f} "
                              f"{median / floor_median:>13.1f}")
        target = statistics.median(rows[0][1])
        verdict = "meets" if target < 1.0 else "misses"
        self.stdout.write(f"\nauthentication median {target:.3f} ms with {key_count} keys: {verdict} the 1 ms target.")
