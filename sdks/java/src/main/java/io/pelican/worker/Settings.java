package io.pelican.worker;

import java.nio.charset.StandardCharsets;
import java.time.Duration;
import java.util.HashMap;
import java.util.Map;
import java.util.OptionalLong;
import java.util.Set;
import java.util.TreeSet;

/**
 * The group's settings hash ({@code {T}:pelican:<stream>:<group>:settings}) as the operator publishes it, times in
 * milliseconds.
 *
 * @param minIdleMs an entry idle this long is taken by the operator's pass
 * @param retryAfterMs an idle time every retry threshold of the policy allows: given back entries get it on shutdown
 * @param maxDeliveries the retry cap (the pass enforces it, never a worker)
 * @param contractVersion the worker contract the operator speaks
 */
public record Settings(long minIdleMs, long retryAfterMs, OptionalLong maxDeliveries, int contractVersion) {
    /** The worker contract versions this library implements. */
    public static final Set<Integer> KNOWN_CONTRACT_VERSIONS = Set.of(1);
    /** The idle time given back entries get when no settings are published: Pelican's default {@code minIdle}. */
    public static final long UNPUBLISHED_IDLE_MS = 300_000;
    /** How often leases are extended when no settings are published. */
    public static final Duration UNPUBLISHED_LEASE_INTERVAL = Duration.ofSeconds(1);

    /**
     * The settings in an {@code HGETALL} reply of a byte codec; {@code null} for an empty hash (no policy yet). The
     * names are decoded before they are looked up: a {@code byte[]} key is never {@code equals} to another, so a
     * lookup in the raw map finds nothing and a silent default would lease at the wrong pace.
     */
    public static Settings parseRaw(Map<byte[], byte[]> hash) {
        return parse(decode(hash), KNOWN_CONTRACT_VERSIONS);
    }

    /** {@link #parseRaw} for a worker that knows the contract versions {@code known} (a topic's partition: 2). */
    static Settings parseRaw(Map<byte[], byte[]> hash, Set<Integer> known) {
        return parse(decode(hash), known);
    }

    /** A hash of a byte codec with its names and values decoded as UTF-8. */
    static Map<String, String> decode(Map<byte[], byte[]> hash) {
        Map<String, String> fields = new HashMap<>();
        hash.forEach((name, value) -> fields.put(
                new String(name, StandardCharsets.UTF_8), new String(value, StandardCharsets.UTF_8)));
        return fields;
    }

    /**
     * The settings in a decoded hash; {@code null} when it is empty.
     *
     * @throws ContractVersionException for a {@code contractVersion} this library does not know (a hash without one
     *     was written before the contract had versions: version 1)
     * @throws SettingsException when {@code minIdleMs} or {@code retryAfterMs} is missing or a field is no decimal
     *     integer
     */
    public static Settings parse(Map<String, String> fields) {
        return parse(fields, KNOWN_CONTRACT_VERSIONS);
    }

    private static Settings parse(Map<String, String> fields, Set<Integer> known) {
        if (fields.isEmpty()) {
            return null;
        }
        String versionText = fields.get("contractVersion");
        int version = 1;
        if (versionText != null) {
            if (!isDecimal(versionText) || versionText.length() > 9
                    || !known.contains(Integer.parseInt(versionText))) {
                throw new ContractVersionException(versionText, known);
            }
            version = Integer.parseInt(versionText);
        }
        OptionalLong minIdle = integer(fields, "minIdleMs");
        OptionalLong retryAfter = integer(fields, "retryAfterMs");
        if (minIdle.isEmpty() || retryAfter.isEmpty()) {
            throw new SettingsException("settings hash without "
                    + (minIdle.isEmpty() ? retryAfter.isEmpty() ? "minIdleMs and retryAfterMs" : "minIdleMs" : "retryAfterMs")
                    + " (fields: " + new TreeSet<>(fields.keySet()) + ")");
        }
        return new Settings(minIdle.getAsLong(), retryAfter.getAsLong(), integer(fields, "maxDeliveries"), version);
    }

    /** Time between lease ticks: {@code min(minIdleMs / 3, 10 s)}, never under 100 ms; 1 s without settings. */
    public static Duration leaseInterval(Settings settings) {
        if (settings == null) {
            return UNPUBLISHED_LEASE_INTERVAL;
        }
        return Duration.ofMillis(Math.min(Math.max(settings.minIdleMs() / 3, 100), 10_000));
    }

    private static OptionalLong integer(Map<String, String> fields, String name) {
        String value = fields.get(name);
        if (value == null) {
            return OptionalLong.empty();
        }
        if (!isDecimal(value) || value.length() > 18) {
            throw new SettingsException("settings field " + name + " is '" + value + "', not a decimal integer");
        }
        return OptionalLong.of(Long.parseLong(value));
    }

    private static boolean isDecimal(String text) {
        return !text.isEmpty() && text.chars().allMatch(c -> c >= '0' && c <= '9');
    }
}
