// A Spring Data Redis worker whose handler may be slower than the group's minIdle, kept from looking abandoned with
// the lease call Pelican documents: the contract's `lease.lua` (the owner's `XCLAIM ... JUSTID` on the messages it is
// still handling, only those still its own: idle back to 0, the delivery count unchanged; and the worker's heartbeat,
// which `strategy: Reassign` reads), every third of the `minIdleMs` the operator publishes in
// `{T}:pelican:<stream>:<group>:settings`, also with nothing in flight. The Java twin of slow_worker.py. A library does
// all this and the rest of the contract: sdks/java (and its Spring Boot example, sdks/java/examples/notifications).
//
//   java -cp ... SlowWorker redis://127.0.0.1:6379 '{orders}:events' billing worker-1 12 100
//
// run from the repository's root (it reads contract/scripts/lease.lua).
//
// handles messages (each takes HANDLE_SECONDS, here 12) until it handled COUNT (here 100) or ran 120 s, printing
// `handled <entry id>` for every run of the handler.

import java.net.URI;
import java.util.ArrayList;
import java.time.Duration;
import java.util.List;
import java.util.Map;
import java.util.Set;
import java.util.concurrent.ConcurrentHashMap;
import java.util.concurrent.ExecutorService;
import java.util.concurrent.Executors;
import java.util.concurrent.atomic.AtomicInteger;

import org.springframework.data.redis.connection.RedisStandaloneConfiguration;
import org.springframework.data.redis.connection.lettuce.LettuceConnectionFactory;
import org.springframework.data.redis.connection.stream.Consumer;
import org.springframework.data.redis.connection.stream.MapRecord;
import org.springframework.data.redis.connection.stream.ReadOffset;
import org.springframework.data.redis.connection.stream.StreamOffset;
import org.springframework.data.redis.connection.stream.StreamReadOptions;
import org.springframework.core.io.FileSystemResource;
import org.springframework.data.redis.core.StringRedisTemplate;
import org.springframework.data.redis.core.script.RedisScript;

public class SlowWorker {
    /** The part of a key Redis Cluster hashes: the first non-empty {...}, else the whole key. */
    static String hashTag(String key) {
        int start = key.indexOf('{');
        if (start >= 0) {
            int end = key.indexOf('}', start + 1);
            if (end > start + 1) {
                return key.substring(start + 1, end);
            }
        }
        return key;
    }

    public static void main(String[] args) throws Exception {
        URI url = URI.create(args[0]);
        String stream = args[1], group = args[2], consumer = args[3];
        long handleMillis = (long) (Double.parseDouble(args[4]) * 1000);
        int count = Integer.parseInt(args[5]);
        LettuceConnectionFactory factory =
            new LettuceConnectionFactory(new RedisStandaloneConfiguration(url.getHost(), url.getPort()));
        factory.afterPropertiesSet();
        factory.start();
        StringRedisTemplate redis = new StringRedisTemplate(factory);

        String keyPrefix = "{" + hashTag(stream) + "}:pelican:" + stream + ":" + group + ":";
        Map<Object, Object> settings = redis.opsForHash().entries(keyPrefix + "settings");
        @SuppressWarnings("rawtypes") // the script answers the ids still this worker's: a list
        RedisScript<List> lease = RedisScript.of(new FileSystemResource("contract/scripts/lease.lua"), List.class);
        // Three leases per minIdle; every second when no policy publishes settings.
        long minIdle = settings.containsKey("minIdleMs") ? Long.parseLong((String) settings.get("minIdleMs")) : 3000;
        long every = minIdle / 3;

        Set<String> inFlight = ConcurrentHashMap.newKeySet();
        AtomicInteger handled = new AtomicInteger();
        ExecutorService handlers = Executors.newCachedThreadPool();
        long deadline = System.currentTimeMillis() + 120_000, lastLease = System.currentTimeMillis();
        while (handled.get() < count && System.currentTimeMillis() < deadline) {
            List<MapRecord<String, Object, Object>> records = redis.opsForStream().read(
                Consumer.from(group, consumer),
                StreamReadOptions.empty().count(16).block(Duration.ofMillis(100)),
                StreamOffset.create(stream, ReadOffset.lastConsumed()));
            for (MapRecord<String, Object, Object> record : records == null ? List.<MapRecord<String, Object, Object>>of() : records) {
                String id = record.getId().getValue();
                inFlight.add(id);
                handlers.submit(() -> {
                    try {
                        Thread.sleep(handleMillis); // the slow part of the handler
                    } catch (InterruptedException e) {
                        return;
                    }
                    redis.opsForStream().acknowledge(stream, group, id);
                    inFlight.remove(id);
                    handled.incrementAndGet();
                    System.out.println("handled " + id);
                });
            }
            if (System.currentTimeMillis() - lastLease >= every) {
                lastLease = System.currentTimeMillis();
                List<String> leaseArgs = new ArrayList<>(List.of(group, consumer));
                inFlight.stream().limit(100).forEach(leaseArgs::add);
                // The lease (EVALSHA, EVAL the first time): Pelican's pass never takes an entry whose idle time stays
                // below minIdle, and the heartbeat it writes is how Reassign knows this worker is alive.
                redis.execute(lease, List.of(stream, keyPrefix + "consumers"), leaseArgs.toArray());
            }
        }
        handlers.shutdownNow();
        factory.destroy();
        System.exit(0);
    }
}
