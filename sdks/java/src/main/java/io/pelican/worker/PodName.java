package io.pelican.worker;

import java.net.InetAddress;
import java.net.UnknownHostException;

/** The Pod's name, the default consumer (and producer) name: {@code spec.consumers.pods} matches by it. */
public final class PodName {
    private PodName() {}

    /** {@code POD_NAME}, else {@code HOSTNAME}, else the host name. */
    public static String get() {
        for (String variable : new String[] {"POD_NAME", "HOSTNAME"}) {
            String value = System.getenv(variable);
            if (value != null && !value.isEmpty()) {
                return value;
            }
        }
        try {
            return InetAddress.getLocalHost().getHostName();
        } catch (UnknownHostException e) {
            throw new IllegalStateException("no POD_NAME, no HOSTNAME and no host name: name the consumer", e);
        }
    }
}
