"""What the scripts that start Envoy or Prometheus on loopback share: an
Envoy listener with one route, a static cluster, a free port and
Prometheus's HTTP API."""

import json
import socket
import urllib.error
import urllib.parse
import urllib.request

ROUTER = {
    "name": "envoy.filters.http.router",
    "typed_config": {"@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"},
}


def address(port):
    return {"socket_address": {"address": "127.0.0.1", "port_value": port}}


def admin(port):
    return {"address": address(port)}


def inbound_listener(port, filters, action):
    """A listener on `port` whose HTTP connection manager runs `filters`,
    then the router, with one route for every path taking `action`
    (`{"direct_response": ...}` or `{"route": {"cluster": ...}}`)."""
    return {
        "name": "inbound",
        "address": address(port),
        "filter_chains": [{"filters": [{
            "name": "envoy.filters.network.http_connection_manager",
            "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.filters.network."
                         "http_connection_manager.v3.HttpConnectionManager",
                "stat_prefix": "inbound",
                "route_config": {"virtual_hosts": [{"name": "app", "domains": ["*"], "routes": [
                    {"match": {"prefix": "/"}, **action}]}]},
                "http_filters": filters + [ROUTER],
            }}]}],
    }


def static_cluster(name, port):
    return {
        "name": name, "type": "STATIC", "connect_timeout": "1s",
        "load_assignment": {"cluster_name": name, "endpoints": [{"lb_endpoints": [
            {"endpoint": {"address": address(port)}}]}]},
    }


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def prometheus_api(port, path, **params):
    """Prometheus's answer to `/api/v1/<path>`, or {} while it does not listen yet."""
    url = f"http://127.0.0.1:{port}/api/v1/{path}?" + urllib.parse.urlencode(params)
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return json.load(r)
    except urllib.error.HTTPError as e:
        return json.load(e)
    except (urllib.error.URLError, ConnectionError):
        return {}
