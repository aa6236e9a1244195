"""``broker.client`` security settings (librdkafka names) for the processor's faust/aiokafka clients.

The confluent-kafka clients (infra/kafka.py, replay, archive) take ``broker.client`` as it is. The stream
processor speaks Kafka through faust's aiokafka driver, which wants a ``broker_credentials`` object
instead: this module builds it from the same librdkafka keys, so one configuration reaches every client.
A security key with no aiokafka equivalent is refused by name rather than silently dropped; other keys
(client tuning such as ``linger.ms``) are librdkafka's alone.
"""
from __future__ import annotations

import ssl
from typing import Mapping

import faust
from faust.types.auth import CredentialsT

PROTOCOLS = ("PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL")
MAPPED_KEYS = frozenset({
    "security.protocol", "sasl.mechanism", "sasl.mechanisms", "sasl.username", "sasl.password",
    "sasl.kerberos.service.name", "ssl.ca.location", "ssl.certificate.location", "ssl.key.location",
    "ssl.key.password", "ssl.endpoint.identification.algorithm", "enable.ssl.certificate.verification",
})
SASL_MECHANISMS = ("PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512", "GSSAPI")


def faust_credentials(client: Mapping[str, str]) -> CredentialsT | None:
    """faust's ``broker_credentials`` for librdkafka security settings; None for plaintext."""
    _refuse_unmapped(client)
    protocol = client.get("security.protocol", "PLAINTEXT").upper()
    if protocol not in PROTOCOLS:
        raise ValueError(f"broker.client security.protocol {protocol!r} is not one of {PROTOCOLS}")
    if protocol == "PLAINTEXT":
        return None
    context = ssl_context(client) if protocol.endswith("SSL") else None
    if protocol == "SSL":
        return faust.SSLCredentials(context)
    mechanism = client.get("sasl.mechanism", client.get("sasl.mechanisms", "GSSAPI")).upper()
    if mechanism not in SASL_MECHANISMS:
        raise ValueError(f"broker.client sasl.mechanism {mechanism!r}: the stream processor (aiokafka) "
                         f"supports {SASL_MECHANISMS}")
    if mechanism == "GSSAPI":
        return faust.GSSAPICredentials(kerberos_service_name=client.get("sasl.kerberos.service.name", "kafka"),
                                       ssl_context=context, mechanism=mechanism)
    return faust.SASLCredentials(username=client.get("sasl.username"), password=client.get("sasl.password"),
                                 ssl_context=context, mechanism=mechanism)


def ssl_context(client: Mapping[str, str]) -> ssl.SSLContext:
    """The TLS context librdkafka would build from its ssl.* settings (system CAs unless a CA file is given)."""
    context = ssl.create_default_context(cafile=client.get("ssl.ca.location"))
    if "ssl.certificate.location" in client:
        context.load_cert_chain(client["ssl.certificate.location"], client.get("ssl.key.location"),
                                client.get("ssl.key.password"))
    if client.get("ssl.endpoint.identification.algorithm", "https").lower() == "none":
        context.check_hostname = False
    if client.get("enable.ssl.certificate.verification", "true").lower() == "false":
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
    return context


def _refuse_unmapped(client: Mapping[str, str]) -> None:
    unmapped = sorted(key for key in client
                      if key.startswith(("ssl.", "sasl.", "security.")) and key not in MAPPED_KEYS)
    if unmapped:
        raise ValueError(f"broker.client {unmapped}: no equivalent for the stream processor's aiokafka clients; "
                         f"supported security keys: {sorted(MAPPED_KEYS)}")
