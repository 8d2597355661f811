package io.pelican.worker;

import java.nio.ByteBuffer;
import java.nio.charset.CharacterCodingException;
import java.nio.charset.CodingErrorAction;
import java.nio.charset.StandardCharsets;
import java.util.ArrayList;
import java.util.Arrays;
import java.util.List;
import java.util.Map;
import java.util.Objects;
import java.util.Optional;
import java.util.OptionalInt;

/**
 * One stream entry: its id and its fields, raw bytes in the order they were added (names may repeat). Pelican's
 * fields on a requeued copy ({@link Keys#DELIVERIES_FIELD}, {@link Keys#ORIGIN_ID_FIELD}) come last.
 */
public final class Message {
    /**
     * One field of an entry.
     *
     * @param name the name, decoded as UTF-8
     * @param value the value as stored
     */
    public record Field(String name, byte[] value) {
        public Field {
            Objects.requireNonNull(name, "name");
            Objects.requireNonNull(value, "value");
        }

        /** The value as UTF-8 text; {@code null} when it is not UTF-8. */
        public String text() {
            return utf8(value);
        }

        @Override
        public boolean equals(Object other) {
            return other instanceof Field that && name.equals(that.name) && Arrays.equals(value, that.value);
        }

        @Override
        public int hashCode() {
            return 31 * name.hashCode() + Arrays.hashCode(value);
        }

        @Override
        public String toString() {
            String text = text();
            return name + "=" + (text != null ? text : Arrays.toString(value));
        }
    }

    private final String id;
    private final List<Field> fields;
    private final OptionalInt partition;

    public Message(String id, List<Field> fields) {
        this(id, fields, OptionalInt.empty());
    }

    /** A message read from a topic's partition: for a handler's unit tests as well. */
    public Message(String id, List<Field> fields, OptionalInt partition) {
        this.id = Objects.requireNonNull(id, "id");
        this.fields = List.copyOf(fields);
        this.partition = Objects.requireNonNull(partition, "partition");
    }

    /** A message with text fields in the map's order: for a handler's unit tests. */
    public static Message of(String id, Map<String, String> fields) {
        List<Field> list = new ArrayList<>(fields.size());
        fields.forEach((name, value) -> list.add(new Field(name, value.getBytes(StandardCharsets.UTF_8))));
        return new Message(id, list);
    }

    /** The entry id, e.g. {@code 1700000000000-0}. */
    public String id() {
        return id;
    }

    /** The partition of a topic it was read from; empty for a message of a plain stream. */
    public OptionalInt partition() {
        return partition;
    }

    /**
     * Its key as text: the {@code pelican-key} field a {@link TopicProducer} writes first; empty without one (or
     * when the key is not UTF-8: {@code bytes(Keys.KEY_FIELD)} has its bytes).
     */
    public Optional<String> key() {
        return Optional.ofNullable(text(Keys.KEY_FIELD));
    }

    /** Every field, in order. */
    public List<Field> fields() {
        return fields;
    }

    /** The value of the first field named {@code name}; {@code null} when there is none. */
    public byte[] bytes(String name) {
        for (Field field : fields) {
            if (field.name().equals(name)) {
                return field.value();
            }
        }
        return null;
    }

    /** The value of the first field named {@code name} as UTF-8 text; {@code null} when missing or not UTF-8. */
    public String text(String name) {
        byte[] value = bytes(name);
        return value == null ? null : utf8(value);
    }

    @Override
    public String toString() {
        return "Message[" + id + (partition.isPresent() ? " of partition " + partition.getAsInt() : "") + ", "
                + fields.size() + " fields]";
    }

    private static String utf8(byte[] value) {
        try {
            return StandardCharsets.UTF_8.newDecoder()
                    .onMalformedInput(CodingErrorAction.REPORT)
                    .onUnmappableCharacter(CodingErrorAction.REPORT)
                    .decode(ByteBuffer.wrap(value))
                    .toString();
        } catch (CharacterCodingException e) {
            return null;
        }
    }
}
