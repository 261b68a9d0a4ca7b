"""The cluster's PKI: two CAs, the service-account signing key and every leaf certificate.

The layout follows kubeadm's: a cluster CA signs the API server's serving certificate
and every client identity (admin, controller manager, scheduler, kube-proxy, nodes,
the API server's kubelet client); a separate front-proxy CA signs the certificate the
aggregator presents to APIService backends, which trust it through the
extension-apiserver-authentication ConfigMap. ECDSA P-256 keys keep generation instant.
"""

from __future__ import annotations

import dataclasses
import datetime
import ipaddress
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from .config import CLUSTER_DOMAIN, ClusterConfig

_VALIDITY = datetime.timedelta(days=365)


@dataclasses.dataclass(frozen=True)
class KeyPair:
    cert: Path
    key: Path


def _name(cn: str, orgs: tuple[str, ...] = ()) -> x509.Name:
    attrs = [x509.NameAttribute(NameOID.ORGANIZATION_NAME, o) for o in orgs]
    attrs.append(x509.NameAttribute(NameOID.COMMON_NAME, cn))
    return x509.Name(attrs)


def _write_key(key: ec.EllipticCurvePrivateKey, path: Path) -> None:
    path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    path.chmod(0o600)


def _builder(subject: x509.Name, issuer: x509.Name, public_key, ca: bool) -> x509.CertificateBuilder:
    """A certificate valid from five minutes ago for ``_VALIDITY``, with the basic
    constraints and key usage of a CA (signs certificates and CRLs) or of a leaf (signs
    and enciphers keys)."""
    now = datetime.datetime.now(datetime.timezone.utc)
    return (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer)
        .public_key(public_key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + _VALIDITY)
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True, key_encipherment=not ca, content_commitment=False,
                data_encipherment=False, key_agreement=False, key_cert_sign=ca,
                crl_sign=ca, encipher_only=False, decipher_only=False,
            ),
            critical=True,
        )
    )


class _Authority:
    """A CA that can sign leaves; kept in memory while the PKI is generated."""

    def __init__(self, directory: Path, name: str, cn: str) -> None:
        self.key = ec.generate_private_key(ec.SECP256R1())
        subject = _name(cn)
        self.cert = (
            _builder(subject, subject, self.key.public_key(), ca=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(self.key.public_key()), False)
            .sign(self.key, hashes.SHA256())
        )
        self.pair = KeyPair(directory / f"{name}.crt", directory / f"{name}.key")
        self.pair.cert.write_bytes(self.cert.public_bytes(serialization.Encoding.PEM))
        _write_key(self.key, self.pair.key)

    def issue(
        self,
        directory: Path,
        name: str,
        cn: str,
        orgs: tuple[str, ...] = (),
        *,
        server: bool = False,
        client: bool = False,
        dns_names: tuple[str, ...] = (),
        ips: tuple[str, ...] = (),
    ) -> KeyPair:
        key = ec.generate_private_key(ec.SECP256R1())
        usages = []
        if server:
            usages.append(ExtendedKeyUsageOID.SERVER_AUTH)
        if client:
            usages.append(ExtendedKeyUsageOID.CLIENT_AUTH)
        builder = (
            _builder(_name(cn, orgs), self.cert.subject, key.public_key(), ca=False)
            .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
            .add_extension(
                x509.AuthorityKeyIdentifier.from_issuer_public_key(self.key.public_key()), False
            )
        )
        if dns_names or ips:
            sans = [x509.DNSName(d) for d in dns_names]
            sans += [x509.IPAddress(ipaddress.ip_address(i)) for i in ips]
            builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
        cert = builder.sign(self.key, hashes.SHA256())
        pair = KeyPair(directory / f"{name}.crt", directory / f"{name}.key")
        pair.cert.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        _write_key(key, pair.key)
        return pair


@dataclasses.dataclass(frozen=True)
class Pki:
    ca: KeyPair
    front_proxy_ca: KeyPair
    apiserver: KeyPair
    apiserver_kubelet_client: KeyPair
    front_proxy_client: KeyPair
    sa_key: Path
    sa_pub: Path
    clients: dict[str, KeyPair]  # component or user name -> client certificate
    kubelets: dict[str, KeyPair]  # node name -> kubelet serving certificate

    @classmethod
    def load_or_create(cls, config: ClusterConfig) -> "Pki":
        """The PKI of this state dir: generated once, reused by later starts."""
        d = config.pki_dir
        names = _client_identities(config)
        pki = cls(
            ca=KeyPair(d / "ca.crt", d / "ca.key"),
            front_proxy_ca=KeyPair(d / "front-proxy-ca.crt", d / "front-proxy-ca.key"),
            apiserver=KeyPair(d / "apiserver.crt", d / "apiserver.key"),
            apiserver_kubelet_client=KeyPair(
                d / "apiserver-kubelet-client.crt", d / "apiserver-kubelet-client.key"
            ),
            front_proxy_client=KeyPair(d / "front-proxy-client.crt", d / "front-proxy-client.key"),
            sa_key=d / "sa.key",
            sa_pub=d / "sa.pub",
            clients={n: KeyPair(d / f"{n}.crt", d / f"{n}.key") for n in names},
            kubelets={
                n.name: KeyPair(d / f"kubelet-{n.name}.crt", d / f"kubelet-{n.name}.key")
                for n in config.node_specs
            },
        )
        if not pki._complete():
            _generate(config)
        return pki

    def _complete(self) -> bool:
        paths = [self.ca.cert, self.front_proxy_ca.cert, self.apiserver.cert, self.sa_pub,
                 self.apiserver_kubelet_client.cert, self.front_proxy_client.cert]
        paths += [p.cert for p in self.clients.values()]
        paths += [p.cert for p in self.kubelets.values()]
        return all(p.exists() for p in paths)


def _client_identities(config: ClusterConfig) -> dict[str, tuple[str, tuple[str, ...]]]:
    """Client certificate name -> (user, groups), as the API server's RBAC sees them."""
    ids = {
        "admin": ("kubernetes-admin", ("system:masters",)),
        "controller-manager": ("system:kube-controller-manager", ()),
        "scheduler": ("system:kube-scheduler", ()),
        "kube-proxy": ("system:kube-proxy", ()),
        "kube-router": ("system:kube-router", ()),  # the node's NetworkPolicy engine
    }
    for node in config.node_specs:
        ids[f"node-{node.name}"] = (f"system:node:{node.name}", ("system:nodes",))
    return ids


def _generate(config: ClusterConfig) -> None:
    d = config.pki_dir
    d.mkdir(parents=True, exist_ok=True)
    ca = _Authority(d, "ca", "kubernetes")
    front = _Authority(d, "front-proxy-ca", "front-proxy-ca")
    svc = "kubernetes.default.svc"
    ca.issue(
        d, "apiserver", "kube-apiserver", server=True,
        dns_names=("localhost", "kubernetes", "kubernetes.default", svc, f"{svc}.{CLUSTER_DOMAIN}"),
        ips=("127.0.0.1", config.advertise_address, config.kubernetes_service_ip),
    )
    ca.issue(d, "apiserver-kubelet-client", "kube-apiserver-kubelet-client",
             ("system:masters",), client=True)
    front.issue(d, "front-proxy-client", "front-proxy-client", client=True)
    for name, (user, groups) in _client_identities(config).items():
        ca.issue(d, name, user, groups, client=True)
    for node in config.node_specs:
        ca.issue(d, f"kubelet-{node.name}", f"system:node:{node.name}", ("system:nodes",),
                 server=True, dns_names=(node.name, "localhost"), ips=(node.gateway, "127.0.0.1"))
    # Service-account tokens are signed with this key (ES256) and verified with its public half.
    sa = ec.generate_private_key(ec.SECP256R1())
    _write_key(sa, d / "sa.key")
    (d / "sa.pub").write_bytes(
        sa.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )
    )
