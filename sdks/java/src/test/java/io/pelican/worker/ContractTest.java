package io.pelican.worker;

import static org.junit.jupiter.api.Assertions.assertArrayEquals;
import static org.junit.jupiter.api.Assertions.assertEquals;
import static org.junit.jupiter.api.Assertions.assertFalse;
import static org.junit.jupiter.api.Assertions.assertNull;
import static org.junit.jupiter.api.Assertions.assertThrows;
import static org.junit.jupiter.api.Assertions.assertTrue;
import static org.junit.jupiter.api.Assumptions.assumeTrue;

import java.io.IOException;
import java.net.URISyntaxException;
import java.nio.charset.StandardCharsets;
import java.nio.file.Files;
import java.nio.file.Path;
import java.time.Duration;
import java.util.ArrayList;
import java.util.LinkedHashMap;
import java.util.List;
import java.util.Map;
import java.util.OptionalLong;
import java.util.TreeMap;
import java.util.stream.Stream;
import org.junit.jupiter.api.Test;

/** The contract's pieces without a server: script copies, key names, settings parsing, reasons, error texts. */
class ContractTest {
    /** The repository's contract, when the library is built in the repository (not from a copy of its own). */
    private static final Path CONTRACT = Path.of(System.getProperty("basedir", ".")).resolve("../../contract").normalize();

    private static void assumeInTheRepository() {
        assumeTrue(Files.isRegularFile(CONTRACT.resolve("VERSION")),
                "no " + CONTRACT + ": the library is built out of the repository, its copies are checked there");
    }

    @Test
    void theJarsScriptsAreTheContractsByteForByte() throws IOException, URISyntaxException {
        assumeInTheRepository();
        Map<String, byte[]> ours = scripts(Path.of(Script.class.getResource("scripts").toURI()));
        Map<String, byte[]> theirs = scripts(CONTRACT.resolve("scripts"));
        assertFalse(theirs.isEmpty(), "no scripts under " + CONTRACT.resolve("scripts"));
        assertEquals(theirs.keySet(), ours.keySet());
        List<String> differ = new ArrayList<>();
        theirs.forEach((name, bytes) -> {
            if (!java.util.Arrays.equals(bytes, ours.get(name))) {
                differ.add(name);
            }
        });
        assertEquals(List.of(), differ, "copies differ from contract/scripts: copy them again "
                + "(cp ../../contract/scripts/*.lua src/main/resources/io/pelican/worker/scripts/)");
        // What the worker runs is what it ships.
        assertArrayEquals(theirs.get("lease.lua"), Script.LEASE.source);
    }

    private static Map<String, byte[]> scripts(Path dir) throws IOException {
        Map<String, byte[]> found = new TreeMap<>();
        try (Stream<Path> files = Files.list(dir)) {
            for (Path file : (Iterable<Path>) files.filter(f -> f.toString().endsWith(".lua"))::iterator) {
                found.put(file.getFileName().toString(), Files.readAllBytes(file));
            }
        }
        return found;
    }

    @Test
    void theLibraryKnowsTheContractsVersion() throws IOException {
        assumeInTheRepository();
        int version = Integer.parseInt(Files.readString(CONTRACT.resolve("VERSION")).trim());
        assertTrue(Settings.KNOWN_CONTRACT_VERSIONS.contains(version));
    }

    @Test
    void theHashTagIsTheFirstNonEmptyBracedPartElseTheName() {
        assertEquals("orders", Keys.hashTag("{orders}:events"));
        assertEquals("b", Keys.hashTag("a{b}c{d}"));
        assertEquals("a{b", Keys.hashTag("{a{b}x"));
        assertEquals("notifications", Keys.hashTag("notifications"));
        assertEquals("empty{}tag", Keys.hashTag("empty{}tag"));
        assertEquals("open{only", Keys.hashTag("open{only"));
    }

    @Test
    void keyNames() {
        assertEquals("{orders}:pelican:{orders}:events:billing:settings", Keys.settings("{orders}:events", "billing"));
        assertEquals("{orders}:pelican:{orders}:events:billing:terminal", Keys.terminal("{orders}:events", "billing"));
        assertEquals("{jobs}:pelican:jobs:w:errors", Keys.errors("jobs", "w"));
        assertEquals("{orders}:pelican:{orders}:events:billing:consumers", Keys.consumers("{orders}:events", "billing"));
        assertEquals("{orders}:pelican:{orders}:events:bounds", Keys.bounds("{orders}:events"));
        assertEquals("{jobs}:pelican:jobs:rejected", Keys.rejected("jobs"));
    }

    @Test
    void settingsAreParsedByDecodedName() {
        // A byte codec's HGETALL: byte[] names, never equal to a lookup's own byte[].
        Map<byte[], byte[]> raw = new LinkedHashMap<>();
        for (String[] field : new String[][] {{"minIdleMs", "4000"}, {"retryAfterMs", "9000"}, {"maxDeliveries", "5"},
                {"contractVersion", "1"}, {"somethingNew", "x"}}) {
            raw.put(field[0].getBytes(StandardCharsets.UTF_8), field[1].getBytes(StandardCharsets.UTF_8));
        }
        assertEquals(new Settings(4000, 9000, OptionalLong.of(5), 1), Settings.parseRaw(raw));
    }

    @Test
    void settingsWithoutAContractVersionAreVersion1AndAnEmptyHashIsNone() {
        assertEquals(new Settings(4000, 9000, OptionalLong.empty(), 1),
                Settings.parse(Map.of("minIdleMs", "4000", "retryAfterMs", "9000")));
        assertNull(Settings.parse(Map.of()));
        assertNull(Settings.parseRaw(Map.of()));
    }

    @Test
    void anUnknownContractVersionNamesBothVersions() {
        for (String version : new String[] {"2", "0", "v1", "", "99999999999", "2.0", " 1", "1x", "１"}) {
            ContractVersionException refused = assertThrows(ContractVersionException.class,
                    () -> Settings.parse(Map.of("minIdleMs", "4000", "retryAfterMs", "9000", "contractVersion", version)));
            assertTrue(refused.getMessage().contains(
                    "the operator speaks worker contract " + version + ", this library knows 1"), refused.getMessage());
            assertTrue(refused.getMessage().contains("upgrade the library"));
            assertEquals(version, refused.operatorVersion());
        }
    }

    @Test
    void theContractVersionIsCheckedBeforeAnyOtherField() {
        for (Map<String, String> fields : List.of(Map.of("contractVersion", "2"),
                Map.of("contractVersion", "2.0", "minIdleMs", "soon"),
                Map.of("contractVersion", "2", "retryAfterMs", "9000", "maxDeliveries", "many"))) {
            ContractVersionException refused = assertThrows(ContractVersionException.class, () -> Settings.parse(fields));
            assertEquals(fields.get("contractVersion"), refused.operatorVersion());
        }
    }

    @Test
    void malformedSettingsAreAnErrorNeverASilentDefault() {
        List<Map<String, String>> malformed = List.of(
                Map.of("retryAfterMs", "9000"),
                Map.of("minIdleMs", "4s", "retryAfterMs", "9000"),
                Map.of("minIdleMs", "-1", "retryAfterMs", "9000"),
                Map.of("minIdleMs", "4000", "retryAfterMs", "9000", "maxDeliveries", "many"),
                Map.of("minIdleMs", "99999999999999999999", "retryAfterMs", "9000"));
        for (Map<String, String> fields : malformed) {
            assertThrows(SettingsException.class, () -> Settings.parse(fields), fields.toString());
        }
    }

    @Test
    void theLeaseIntervalIsAThirdOfMinIdleWithin100MsAnd10S() {
        assertEquals(Duration.ofSeconds(1), Settings.leaseInterval(null));
        assertEquals(Duration.ofSeconds(1), Settings.leaseInterval(new Settings(3000, 0, OptionalLong.empty(), 1)));
        assertEquals(Duration.ofMillis(100), Settings.leaseInterval(new Settings(120, 0, OptionalLong.empty(), 1)));
        assertEquals(Duration.ofSeconds(10), Settings.leaseInterval(new Settings(300_000, 0, OptionalLong.empty(), 1)));
    }

    @Test
    void reasonsAreCamelCaseUpTo63Characters() {
        assertEquals("RecordNotFound", Outcome.terminal("RecordNotFound").reason());
        assertEquals("X", Outcome.terminal("X").reason());
        assertEquals("A" + "b".repeat(62), Outcome.terminal("A" + "b".repeat(62)).reason());
        for (String bad : new String[] {"", "recordNotFound", "Record_Not_Found", "Record Not", "Ünicode",
                "RecordNotFound\n", "A" + "b".repeat(63), null}) {
            InvalidReasonException refused = assertThrows(InvalidReasonException.class, () -> Outcome.terminal(bad));
            assertTrue(refused.getMessage().contains("^[A-Z][A-Za-z0-9]{0,62}$"));
        }
        assertEquals(Outcome.Kind.DONE, Outcome.done().kind());
        assertNull(Outcome.retry().reason());
    }

    @Test
    void theErrorTextIsCutTo1024BytesAtACharacterBoundary() {
        assertEquals("IllegalStateException: job-1", Worker.errorText(new IllegalStateException("job-1")));
        assertEquals("RuntimeException", Worker.errorText(new RuntimeException()));
        byte[] cut = Worker.errorText(new IllegalArgumentException("€".repeat(1000))).getBytes(StandardCharsets.UTF_8);
        String prefix = "IllegalArgumentException: ";
        assertEquals(prefix.length() + 3 * ((1024 - prefix.length()) / 3), cut.length);
        assertTrue(new String(cut, StandardCharsets.UTF_8).startsWith(prefix + "€"));
        assertEquals("ab", Worker.cutUtf8("ab€", 4));
        assertEquals("ab€", Worker.cutUtf8("ab€", 5));
    }

    @Test
    void messageFields() {
        Message m = new Message("1-0", List.of(new Message.Field("a", new byte[] {(byte) 0xff}),
                new Message.Field("a", "2".getBytes(StandardCharsets.UTF_8)),
                new Message.Field("job", "é".getBytes(StandardCharsets.UTF_8))));
        assertArrayEquals(new byte[] {(byte) 0xff}, m.bytes("a"));
        assertNull(m.text("a"));
        assertEquals("é", m.text("job"));
        assertNull(m.bytes("b"));
        assertEquals("2", m.fields().get(1).text());
        assertEquals(Message.of("1-0", Map.of("job", "é")).fields().get(0), m.fields().get(2));
    }
}
