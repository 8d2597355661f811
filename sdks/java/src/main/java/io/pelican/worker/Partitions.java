package io.pelican.worker;

import java.nio.charset.StandardCharsets;
import java.util.Map;
import java.util.zip.CRC32;

/**
 * A topic's partitions (contract/README.md, "Topics (contract version 2)"): a policy with {@code spec.partitions: N}
 * makes its stream {@code T} the N streams <code>{T:0}</code> .. <code>{T:N-1}</code>, and a keyed message goes to
 * the partition of its key.
 */
public final class Partitions {
    /** The worker contract of a topic: its description and its settings say it. */
    public static final int TOPIC_CONTRACT_VERSION = 2;
    /** The most partitions a topic has (the operator's admission refuses more). */
    public static final int MAX = 1024;

    private Partitions() {}

    /**
     * The partition of {@code key} in a topic of {@code partitions}: CRC-32 (ISO-HDLC, zlib's) of its bytes, modulo
     * {@code partitions}, as every library computes it ({@code contract/partitions.json}). An empty key is a key.
     *
     * @throws IllegalArgumentException when {@code partitions} is below 1
     */
    public static int of(byte[] key, int partitions) {
        if (partitions < 1) {
            throw new IllegalArgumentException("a topic has 1 or more partitions, not " + partitions);
        }
        CRC32 crc = new CRC32();
        crc.update(key);
        return (int) (crc.getValue() % partitions);
    }

    /** The partition of a text key: of its UTF-8 bytes. */
    public static int of(String key, int partitions) {
        return of(key.getBytes(StandardCharsets.UTF_8), partitions);
    }

    /**
     * N as a topic's description ({@code group} null) or a group's settings hash says it, the contract version
     * first: a later version may describe partitions anew.
     *
     * @throws TopicContractException when the hash names another contract version, or partitions without one
     * @throws NotATopicException when it describes no topic
     */
    static int described(String topic, String group, Map<String, String> fields) {
        String version = fields.get("contractVersion");
        String partitions = fields.get("partitions");
        boolean decimal = partitions != null && !partitions.isEmpty() && partitions.length() <= 9
                && partitions.chars().allMatch(c -> c >= '0' && c <= '9');
        if (version != null ? !version.equals(Integer.toString(TOPIC_CONTRACT_VERSION)) : decimal) {
            throw new TopicContractException(topic, version);
        }
        int n = decimal ? Integer.parseInt(partitions) : 0;
        if (n < 1 || n > MAX) {
            throw new NotATopicException(topic, group);
        }
        return n;
    }
}
