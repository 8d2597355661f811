package io.pelican.examples.notifications;

import io.lettuce.core.RedisURI;
import io.pelican.worker.Message;
import io.pelican.worker.Outcome;
import io.pelican.worker.TopicWorker;
import org.springframework.beans.factory.annotation.Value;
import org.springframework.boot.SpringApplication;
import org.springframework.boot.autoconfigure.SpringBootApplication;
import org.springframework.context.annotation.Bean;

/**
 * Seed 001's notification worker: no @Scheduled XCLAIM loop, no dead-letter table; the group's policy does both. The
 * stream is a topic ordered per key ({@code examples/ordered.yaml}): its publishers key each message by subscriber
 * ({@code TopicProducer.publishKeyed(subscriberId, ...)}), so one subscriber's notifications are sent one at a time and
 * in the order they were published (a failing one is retried in place, holding back only its subscriber's), while
 * other subscribers' go on side by side, over as many replicas as the topic has partitions.
 */
@SpringBootApplication
public class NotificationsApplication {
    public static void main(String[] args) {
        SpringApplication.run(NotificationsApplication.class, args);
    }

    /**
     * start() once made: it joins the topic's group (refusing a topic no policy describes yet, or a newer contract: the
     * Pod restarts until the policy is there); close() at shutdown finishes or gives back what is in hand and leaves, so
     * its partitions go to the other replicas at once.
     */
    @Bean(initMethod = "start", destroyMethod = "close")
    TopicWorker notificationWorker(NotificationService notifications, @Value("${spring.data.redis.url}") String url) {
        return TopicWorker.builder(RedisURI.create(url)).topic("subscribed-stream").group("notification")
                .handler(message -> handle(notifications, message)).build();
    }

    /** One message of the subscribed stream: notify the subscriber of the target's news. */
    static Outcome handle(NotificationService notifications, Message message) throws Exception {
        long subscriberId = Long.parseLong(message.text("subscriberId"));
        long targetId = Long.parseLong(message.text("targetId"));
        try {
            notifications.send(subscriberId, targetId, message.id()); // a provider outage throws: retried by the policy
        } catch (NotificationService.RecipientNotFoundException e) {
            return Outcome.terminal("RecipientNotFound"); // acknowledged and counted, never retried
        }
        return Outcome.done();
    }
}
